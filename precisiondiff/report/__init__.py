"""Report: terminal tables, JSON/CSV, the self-contained HTML report with plots, dump listings.

May import compare/, store/ and comparators/; never the faces (cli/, testing/).
"""
