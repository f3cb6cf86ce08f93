"""Serve a Model Explorer overlay written by ``precisiondiff report --model-explorer`` on
localhost, with the graph exported in this process (so custom ops of the workload are known),
for docs/img screenshots (tools/screenshots.sh)::

    python tools/serve_model_explorer.py WORKLOAD OVERLAY.json [PORT]
"""
import sys

import model_explorer

from precisiondiff.report.model_explorer import export_graph

if __name__ == "__main__":
    spec, overlay = sys.argv[1], sys.argv[2]
    port = int(sys.argv[3]) if len(sys.argv) > 3 else 8089
    config = model_explorer.config()
    config.add_model_from_pytorch(spec.rpartition("/")[2], exported_program=export_graph(spec))
    config.add_node_data_from_path(overlay)
    model_explorer.visualize_from_config(config=config, host="127.0.0.1", port=port, no_open_in_browser=True)
