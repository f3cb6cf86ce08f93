// The compiled front of op-level capture (precisiondiff/capture/compiled.py).
//
// A boxed fallback on a dispatch key held in thread-local state sees every op call before
// autograd. For the common op (no write, plain CPU tensors) it records the call itself: the
// inputs before the op runs and the outputs after, a floating tensor measured at once by the same
// statistics kernel as the Python path (its C entry point), any other through a Python callback
// (StatsBatch); it formats the events' records itself. The op then runs with the Python dispatch key
// excluded, so the Python TorchDispatchMode (still pushed) never sees it. Every other op, and
// every op while the Python side says so (paused, a collective in flight...), goes on to that
// mode: the Python path stays the oracle and the fallback, per op.
//
// A CompositeImplicitAutograd op is not recorded: it decomposes at the autograd key and its
// parts come back here one by one, as the Python mode (below autograd) sees them.
//
// The key is c10's TESTING_ONLY_GenericMode: the one functionality key reserved for a mode
// enabled through TLS; nothing else in PyTorch registers to it (its comment asks tests only to
// use it, within one process: capture owns it while a session runs, in this process).
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/DynamicTypes.h>

#include <cmath>
#include <limits>
#include <map>
#include <unordered_map>
#include <vector>

namespace {

constexpr auto kHook = c10::DispatchKey::TESTING_ONLY_GenericMode;

enum Code : int { kSlow = 0, kPass = 1, kRecord = 2, kComposite = 3 };

struct Entry {
  py::object slot;     // "input.0" ...
  py::object dtype;    // torch.dtype
  std::vector<int64_t> shape;
  int64_t handle = -1; // a StatsBatch handle, or -(row + 1): a row of the kernel's results here
  int code = 0;        // its ScalarType
};

struct Event {
  const void* op;  // the op's schema: names[op]
  int64_t key;     // (scope, direction): keys[key]
  std::vector<Entry> tensors;
};

struct Key {  // a (scope, direction) the Python side's gate returned
  std::string scope, direction;
  py::object scope_obj, direction_obj;
};

// The fused statistics kernel's C entry point (capture/_stats_jit.py, cstats_*): the tensor's
// address and element count, then the addresses of its infinities' keys, the salt table, its
// prefix sums, the 7 float64 results and the 2 fingerprint words.
using StatsFn = void (*)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);

struct State {
  bool on = false;
  py::object gate;      // () -> int: key id (scope, direction), or -1: the Python mode records it
  py::object describe;  // (qualified name, overload) -> Code
  py::object measure;   // (tensor) -> statistics handle (large tensors)
  py::object drain_cb;  // () -> None: Python takes the pending events now
  py::object plain_types;  // (torch.Tensor, torch.nn.Parameter)
  std::vector<PyObject*> plain_type_ptrs;  // the same, read without the GIL
  std::unordered_map<const void*, int> codes;
  std::unordered_map<const void*, py::object> names;
  std::unordered_map<const void*, std::string> name_strs;
  std::vector<Key> keys;
  std::map<std::pair<int64_t, const void*>, py::object> idents;  // ("op", scope, name, direction)
  std::unordered_map<int, py::object> dtype_names;
  std::vector<py::object> input_slots, output_slots;
  std::unordered_map<int, py::object> dtypes;
  std::vector<Event> pending;
  StatsFn kernels[4] = {nullptr, nullptr, nullptr, nullptr};  // float32, float64, bfloat16, float16
  int64_t infinities[4] = {0, 0, 0, 0};
  int64_t table = 0, cumulative = 0;
  std::vector<double> rows;     // 7 per tensor measured here, since the last drain
  std::vector<uint64_t> words;  // 2 per tensor
  std::vector<int64_t> numels;
  size_t batch = 256;
  int64_t fast_events = 0, slow_calls = 0;
  std::string error;
};

State& state() {
  static State* s = new State();  // never destroyed: Python objects outlive no interpreter
  return *s;
}

const c10::DispatchKeySet kPythonKeys = c10::DispatchKeySet(
    {c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot});
const c10::DispatchKeySet kMine = c10::DispatchKeySet(kHook);

// Redispatch below this hook, with the Python mode seeing the op (it records it, or not).
void to_python(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard guard(kMine);
  op.redispatchBoxed(ks - kMine, stack);
}

// Redispatch below this hook with the Python mode out of the way (the op is recorded here).
void unseen(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard guard(kMine | kPythonKeys);
  op.redispatchBoxed(ks - kMine - kPythonKeys, stack);
}

int code_of(State& s, const c10::OperatorHandle& op) {
  const void* id = &op.schema();
  auto it = s.codes.find(id);
  if (it != s.codes.end()) return it->second;
  int code;
  if (op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
    code = kComposite;
  } else {
    const auto& name = op.schema().name();
    auto sep = name.find("::");
    std::string qualified = name.substr(0, sep) + "." + name.substr(sep + 2);
    std::string overload = op.schema().overload_name().empty() ? "default" : op.schema().overload_name();
    code = py::cast<int>(s.describe(qualified, overload));
    if (code == kRecord) {
      s.names[id] = py::str(qualified + "." + overload);
      s.name_strs[id] = qualified + "." + overload;
    }
  }
  s.codes[id] = code;
  return code;
}

// Whether the compiled path can record a call with this tensor argument (else the call goes to
// the Python mode): a CPU tensor with strides, of no Python subclass but Parameter.
bool plain(State& s, const at::Tensor& t) {
  // a negative or conjugate view is resolved below autograd by a clone the Python mode records
  // (no storage: a functional or fake wrapper while something traces)
  if (!t.defined() || !t.device().is_cpu() || t.layout() != c10::kStrided || t.is_neg() || t.is_conj() ||
      t.key_set().has(c10::DispatchKey::Python) || !t.has_storage())
    return false;
  PyObject* obj = t.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj();
  if (obj != nullptr) {  // a Python subclass has its own rules (local_view)
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
    bool known = false;
    for (PyObject* cls : s.plain_type_ptrs) known = known || cls == type;
    if (!known) return false;
  }
  return true;
}

int kernel_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kDouble: return 1;
    case at::kBFloat16: return 2;
    case at::kHalf: return 3;
    default: return -1;
  }
}

// The tensors of an argument or a result, in the order the Python mode flattens them. A wrapped
// number (``x / 4.0``) reaches Python as the number: not a tensor there, not one here.
template <typename F>
void each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    // an undefined tensor (an output a backward's mask left out) reaches Python as None
    const auto& t = v.toTensor();
    if (t.defined() && !t.unsafeGetTensorImpl()->is_wrapped_number()) f(t);
  } else if (v.isTensorList()) {
    for (const auto& t : v.toTensorList()) f(static_cast<at::Tensor>(t));
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) each_tensor(e, f);
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) each_tensor(e, f);
  }
}

py::object slot_name(std::vector<py::object>& cache, const char* prefix, size_t i) {
  while (cache.size() <= i) cache.push_back(py::str(std::string(prefix) + std::to_string(cache.size())));
  return cache[i];
}

py::object dtype_of(State& s, const at::Tensor& t) {
  int k = static_cast<int>(t.scalar_type());
  auto it = s.dtypes.find(k);
  if (it != s.dtypes.end()) return it->second;
  py::object d = py::reinterpret_borrow<py::object>(
      reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type())));
  s.dtypes[k] = d;
  return d;
}

// Record ``t``: a floating tensor is measured here by the fused kernel (a strided one read in
// row-major order, as the Python path's NumPy copy reads it); any other (an integer, a negative
// view, an empty tensor) through the Python side's StatsBatch, as the Python path measures it.
void add(State& s, Event& ev, py::object slot, const at::Tensor& t) {
  Entry e;
  e.slot = std::move(slot);
  e.dtype = dtype_of(s, t);
  int code = static_cast<int>(t.scalar_type());
  if (s.dtype_names.find(code) == s.dtype_names.end()) {  // "float32": str(torch.float32) less "torch."
    std::string full = py::str(e.dtype);
    s.dtype_names[code] = py::str(full.rfind("torch.", 0) == 0 ? full.substr(6) : full);
  }
  e.code = code;
  e.shape = t.sizes().vec();
  int k = kernel_of(t);
  int64_t n = t.numel();
  if (k >= 0 && s.kernels[k] != nullptr && n > 0 && !t.is_neg() && !t.is_conj()) {
    at::Tensor src = t.is_contiguous() ? t : t.contiguous();
    size_t row = s.numels.size();
    s.rows.resize(7 * (row + 1));
    s.words.resize(2 * (row + 1));
    s.kernels[k](reinterpret_cast<int64_t>(src.data_ptr()), n, s.infinities[k], s.table, s.cumulative,
                 reinterpret_cast<int64_t>(&s.rows[7 * row]), reinterpret_cast<int64_t>(&s.words[2 * row]));
    s.numels.push_back(n);
    e.handle = -static_cast<int64_t>(row) - 1;
  } else {
    e.handle = py::cast<int64_t>(s.measure(t));
  }
  ev.tensors.push_back(std::move(e));
}

void fail(State& s, const std::exception& err) {
  s.on = false;  // the Python mode records everything from here on; Python reads the error
  s.error = err.what();
}

// The Python side's gate (CompiledOps._gate): the key id of (scope, direction) to record the
// call under, or -1. Called through the C API: pybind's call and cast cost ~0.2 us more per call.
int64_t ask_gate(State& s) {
  PyObject* r = PyObject_CallNoArgs(s.gate.ptr());
  if (r == nullptr) throw py::error_already_set();
  long long key = PyLong_AsLongLong(r);
  Py_DECREF(r);
  if (key == -1 && PyErr_Occurred()) throw py::error_already_set();
  return key;
}

void hook(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  State& s = state();
  if (!s.on) return to_python(op, ks, stack);
  const auto& schema = op.schema();
  auto args = torch::jit::last(*stack, schema.arguments().size());
  int code;
  int64_t key = -1;
  bool recorded = false;
  Event ev;
  {
    // one hold of the GIL for the op's code, the gate and the inputs' records
    py::gil_scoped_acquire gil;
    try {
      code = code_of(s, op);
      if (code == kPass || code == kRecord) key = ask_gate(s);
      if (code == kRecord && key >= 0) {
        // every tensor argument must be one the compiled path measures
        bool ok = true;
        for (const auto& a : args) each_tensor(a, [&](const at::Tensor& t) { ok = ok && plain(s, t); });
        if (ok) {
          c10::impl::ExcludeDispatchKeyGuard guard(kMine | kPythonKeys);
          at::NoGradGuard no_grad;
          ev.op = &schema;
          ev.key = key;
          std::vector<const c10::TensorImpl*> seen;
          size_t i = 0;
          for (const auto& a : args) {
            each_tensor(a, [&](const at::Tensor& t) {
              size_t index = i++;
              const auto* impl = t.unsafeGetTensorImpl();
              for (auto* other : seen)
                if (other == impl) return;
              seen.push_back(impl);
              add(s, ev, slot_name(s.input_slots, "input.", index), t);
            });
          }
          recorded = true;
        }
      }
    } catch (const std::exception& err) {
      fail(s, err);  // the Python mode records this call and every later one
      ev.tensors.clear();  // its Python objects released while the GIL is held
      code = kSlow;
    }
  }
  if (code == kComposite) {
    if (!ks.has_any(c10::autograd_dispatch_keyset)) {
      // no autograd key (a factory call, inference mode): the op itself may reach the Python
      // mode, which then records it and not its parts, as without this hook
      s.slow_calls++;
      return to_python(op, ks, stack);
    }
    op.redispatchBoxed(ks - kMine, stack);  // decomposed at the autograd key; the parts come back here
    return;
  }
  if (code == kSlow || key < 0) {
    s.slow_calls++;
    return to_python(op, ks, stack);
  }
  if (code == kPass) {
    // a subclass (a fake tensor while Dynamo traces, a DTensor) runs its own __torch_dispatch__
    // below: the Python keys must stay for it
    bool subclass = false;
    for (const auto& a : args)
      each_tensor(a, [&](const at::Tensor& t) {
        subclass = subclass || (t.defined() && t.key_set().has(c10::DispatchKey::Python));
      });
    return subclass ? to_python(op, ks, stack) : unseen(op, ks, stack);
  }
  if (!recorded) {  // an argument the compiled path does not measure
    s.slow_calls++;
    return to_python(op, ks, stack);
  }
  unseen(op, ks, stack);
  size_t n_out = schema.returns().size();
  auto outs = torch::jit::last(*stack, n_out);
  py::gil_scoped_acquire gil;
  c10::impl::ExcludeDispatchKeyGuard guard(kMine | kPythonKeys);
  at::NoGradGuard no_grad;
  try {
    size_t i = 0;
    for (const auto& o : outs) {
      each_tensor(o, [&](const at::Tensor& t) { add(s, ev, slot_name(s.output_slots, "output.", i++), t); });
    }
    s.pending.push_back(std::move(ev));
    s.fast_events++;
    if (s.pending.size() >= s.batch) s.drain_cb();
  } catch (const std::exception& err) {
    fail(s, err);
  }
  ev.tensors.clear();  // (moved from, or failed) before the GIL is released
}

// -- the Python side's interface ---------------------------------------------------------------

void configure(py::object gate, py::object describe, py::object measure, py::object drain_cb,
               py::object plain_types, std::vector<int64_t> kernels, std::vector<int64_t> infinities,
               int64_t table, int64_t cumulative, int64_t batch) {
  State& s = state();
  s.gate = gate;
  s.describe = describe;
  s.measure = measure;
  s.drain_cb = drain_cb;
  s.plain_types = plain_types;
  s.plain_type_ptrs.clear();
  for (auto cls : plain_types) s.plain_type_ptrs.push_back(cls.ptr());
  for (int k = 0; k < 4; ++k) {
    s.kernels[k] = k < static_cast<int>(kernels.size()) ? reinterpret_cast<StatsFn>(kernels[k]) : nullptr;
    s.infinities[k] = k < static_cast<int>(infinities.size()) ? infinities[k] : 0;
  }
  s.table = table;
  s.cumulative = cumulative;
  s.rows.clear();
  s.words.clear();
  s.numels.clear();
  s.batch = static_cast<size_t>(batch);
  s.codes.clear();
  s.names.clear();
  s.name_strs.clear();
  s.keys.clear();
  s.idents.clear();
  s.pending.clear();
  s.fast_events = s.slow_calls = 0;
  s.error.clear();
}

void enable(bool on) {
  state().on = on;
  c10::impl::tls_set_dispatch_key_included(kHook, on);
}

// Raw CPython calls below: each record is built from ~20 objects per event, where pybind's
// accessors cost several times the C API's (measured: 7.7 -> 1.5 us per event).
static void put(PyObject* d, PyObject* key, PyObject* value) {  // steals ``value``
  if (value == nullptr) throw py::error_already_set();
  int rc = PyDict_SetItem(d, key, value);
  Py_DECREF(value);
  if (rc != 0) throw py::error_already_set();
}

static PyObject* keep(PyObject* o) {  // a borrowed reference as a new one
  Py_INCREF(o);
  return o;
}

static PyObject* intern(const char* name) {  // never released (module-lifetime constants)
  return PyUnicode_InternFromString(name);
}

// A dict sized for ``n`` items: grown from the default size, a record's 6-11 items cost two
// resizes (a new table, every key re-inserted) each.
static PyObject* new_dict(Py_ssize_t n) {
#if PY_VERSION_HEX < 0x030E0000
  PyObject* d = _PyDict_NewPresized(n);
#else
  PyObject* d = PyDict_New();
#endif
  if (d == nullptr) throw py::error_already_set();
  return d;
}

// The fingerprint's two words as 32 lowercase hex digits ("%016llx%016llx" without printf).
static PyObject* hex_words(uint64_t hi, uint64_t lo) {
  static const char digits[] = "0123456789abcdef";
  char hex[32];
  for (int i = 15; i >= 0; --i, hi >>= 4) hex[i] = digits[hi & 15];
  for (int i = 31; i >= 16; --i, lo >>= 4) hex[i] = digits[lo & 15];
  return PyUnicode_FromStringAndSize(hex, 32);
}

// The statistics record of the i-th tensor the kernel measured, as StatsBatch formats the
// kernel's rows (stats.py, _resolve_fused): the same keys in the same order, the same doubles
// (IEEE division and square root are correctly rounded in C++ as in Python).
PyObject* stats_dict(State& s, size_t i) {
  static PyObject* nan = PyFloat_FromDouble(std::numeric_limits<double>::quiet_NaN());
  static PyObject* keys[] = {intern("min"), intern("max"), intern("mean"), intern("abs_mean"), intern("norm"),
                             intern("nan"), intern("inf"), intern("fingerprint")};
  const double* r = &s.rows[7 * i];
  double n = static_cast<double>(s.numels[i]);
  bool has_nan = r[5] != 0.0;
  PyObject* d = new_dict(8);
  try {
    put(d, keys[0], has_nan ? keep(nan) : PyFloat_FromDouble(r[0]));
    put(d, keys[1], has_nan ? keep(nan) : PyFloat_FromDouble(r[1]));
    put(d, keys[2], PyFloat_FromDouble(r[2] / n));
    put(d, keys[3], PyFloat_FromDouble(r[3] / n));
    put(d, keys[4], PyFloat_FromDouble(std::sqrt(r[4])));
    put(d, keys[5], PyLong_FromLongLong(static_cast<long long>(r[5])));
    put(d, keys[6], PyLong_FromLongLong(static_cast<long long>(r[6])));
    put(d, keys[7], hex_words(s.words[2 * i], s.words[2 * i + 1]));
  } catch (...) {
    Py_DECREF(d);
    throw;
  }
  return d;
}

// The call identities of the events recorded since the last build, in order: the Python side's
// ``("op", scope, name, direction)`` keys of its call counters (the same tuple objects each time).
py::list idents() {
  State& s = state();
  py::list out(s.pending.size());
  size_t i = 0;
  for (const auto& ev : s.pending) {
    auto id = std::make_pair(ev.key, ev.op);
    auto it = s.idents.find(id);
    if (it == s.idents.end()) {
      const Key& k = s.keys.at(ev.key);
      it = s.idents.emplace(id, py::make_tuple("op", k.scope_obj, s.names.at(ev.op), k.direction_obj)).first;
    }
    out[i++] = it->second;
  }
  return out;
}

// The records of the events recorded since the last build, as Recorder.flush writes them (the
// same keys in the same order), with their call numbers ``calls`` (from the Python side's
// counters, in the order of :func:`idents`), sequence numbers from ``first_seq``, ``step``,
// ``rank`` and ``step_prefix`` ("step{N}/" or ""). A tensor measured through StatsBatch gets its
// statistics at the read-back: (record, handle) in ``fixups``. Returns (events, fixups).
py::tuple build(const std::vector<int64_t>& calls, int64_t first_seq, int64_t step, int64_t rank,
                const std::string& step_prefix) {
  State& s = state();
  static PyObject* f[] = {intern("seq"), intern("step"), intern("rank"), intern("kind"), intern("scope"),
                          intern("name"), intern("direction"), intern("call"), intern("device"), intern("tensors"),
                          intern("args"), intern("key"), intern("slot"), intern("dtype"), intern("shape"),
                          intern("stats"), intern("data_key"), intern("op"), intern("cpu")};
  std::vector<Event> events;
  events.swap(s.pending);
  py::list out, fixups;
  py::object step_obj = py::int_(step), rank_obj = py::int_(rank);
  int64_t seq = first_seq;
  std::string key;  // one buffer for every record's key
  for (size_t i = 0; i < events.size(); ++i) {
    Event& ev = events[i];
    if (ev.tensors.empty()) continue;  // numbered, not emitted (Recorder.finish)
    const Key& k = s.keys.at(ev.key);
    key.assign(step_prefix).append(k.scope).append("/").append(s.name_strs.at(ev.op)).append("#")
        .append(std::to_string(calls.at(i))).append(":").append(k.direction).append(":");
    size_t prefix_len = key.size();
    py::list tensors(ev.tensors.size());
    for (size_t j = 0; j < ev.tensors.size(); ++j) {
      Entry& e = ev.tensors[j];
      py::list shape(e.shape.size());
      for (size_t d = 0; d < e.shape.size(); ++d) {
        PyObject* dim = PyLong_FromLongLong(e.shape[d]);
        if (dim == nullptr) throw py::error_already_set();
        PyList_SET_ITEM(shape.ptr(), d, dim);
      }
      py::object r = py::reinterpret_steal<py::object>(new_dict(6));
      Py_ssize_t slot_len = 0;
      const char* slot = PyUnicode_AsUTF8AndSize(e.slot.ptr(), &slot_len);
      key.resize(prefix_len);
      key.append(slot, static_cast<size_t>(slot_len));
      put(r.ptr(), f[11], PyUnicode_FromStringAndSize(key.data(), static_cast<Py_ssize_t>(key.size())));
      put(r.ptr(), f[12], keep(e.slot.ptr()));
      put(r.ptr(), f[13], keep(s.dtype_names.at(e.code).ptr()));
      put(r.ptr(), f[14], keep(shape.ptr()));
      if (e.handle < 0) {
        put(r.ptr(), f[15], stats_dict(s, static_cast<size_t>(-e.handle - 1)));
      } else {
        put(r.ptr(), f[15], keep(Py_None));
        fixups.append(py::make_tuple(r, e.handle));
      }
      put(r.ptr(), f[16], keep(Py_None));
      PyList_SET_ITEM(tensors.ptr(), j, r.release().ptr());
    }
    py::object d = py::reinterpret_steal<py::object>(new_dict(11));
    put(d.ptr(), f[0], PyLong_FromLongLong(seq++));
    put(d.ptr(), f[1], keep(step_obj.ptr()));
    put(d.ptr(), f[2], keep(rank_obj.ptr()));
    put(d.ptr(), f[3], keep(f[17]));
    put(d.ptr(), f[4], keep(k.scope_obj.ptr()));
    put(d.ptr(), f[5], keep(s.names.at(ev.op).ptr()));
    put(d.ptr(), f[6], keep(k.direction_obj.ptr()));
    put(d.ptr(), f[7], PyLong_FromLongLong(calls.at(i)));
    put(d.ptr(), f[8], keep(f[18]));
    put(d.ptr(), f[9], keep(tensors.ptr()));
    put(d.ptr(), f[10], keep(Py_None));
    out.append(d);
  }
  s.rows.clear();
  s.words.clear();
  s.numels.clear();
  return py::make_tuple(out, fixups);
}

void add_key(int64_t id, const std::string& scope, const std::string& direction) {
  State& s = state();
  if (static_cast<int64_t>(s.keys.size()) != id) throw std::runtime_error("keys out of order");
  s.keys.push_back(Key{scope, direction, py::str(scope), py::str(direction)});
}

size_t pending() { return state().pending.size(); }

py::tuple counts() {
  State& s = state();
  return py::make_tuple(s.fast_events, s.slow_calls, s.error);
}

void reset() {
  State& s = state();
  enable(false);
  s.pending.clear();
  s.rows.clear();
  s.words.clear();
  s.numels.clear();
  s.gate = s.describe = s.measure = s.drain_cb = s.plain_types = py::object();
  s.plain_type_ptrs.clear();
}

}  // namespace

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&hook>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("configure", &configure);
  m.def("enable", &enable);
  m.def("idents", &idents);
  m.def("build", &build);
  m.def("add_key", &add_key);
  m.def("pending", &pending);
  m.def("counts", &counts);
  m.def("reset", &reset);
}
