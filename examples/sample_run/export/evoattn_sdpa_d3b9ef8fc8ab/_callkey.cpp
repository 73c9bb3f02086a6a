// attention()'s per-call work, in C++: the call key, the table lookup and the entry's call.
//
// call(table, miss, args, kwargs) forms the key of one eager call, looks it up in `table` (a
// dict: key -> entry) and returns entry(*args, **kwargs); on a miss it asks
// miss(args, kwargs, key) for the entry first. An entry that is a tuple (_route.Direct: a
// counted fallback) is called here: its count raised, its function called with the call's
// leading tensors and the values its key fixes, with no Python frame. The key holds, for each
// positional argument in order, a plain tensor's dim, sizes, strides, dtype, device, layout
// and requires_grad (packed into one bytes object) or the value itself; then each keyword
// argument's name and value in the order given; and whether grad mode is on: everything the
// Python key (_keys.key) keeps, so a key never joins calls the Python key would tell apart.
// Where the key cannot be formed here (a tensor subclass, a nested tensor, a tensor passed by
// name, more arguments than the buffers hold) `key` is None and miss decides with the Python
// key.
#include <Python.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

constexpr Py_ssize_t kMaxWords = 512;
constexpr Py_ssize_t kMaxValues = 64;
constexpr int64_t kValue = -1;             // a positional argument that is not a tensor
constexpr int64_t kNamed = -2;             // a keyword argument (its name and value follow)

// Returns a new reference: the key, Py_None where it cannot be formed, or NULL on an error.
// The key is (packed tensor facts and markers, the other values in order, grad mode).
PyObject* make_key(PyObject* args, PyObject* kwargs) {
  int64_t words[kMaxWords];
  PyObject* values[kMaxValues];            // borrowed
  Py_ssize_t n = 0, m = 0;
  const Py_ssize_t count = PyTuple_GET_SIZE(args);
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* a = PyTuple_GET_ITEM(args, i);
    if (Py_TYPE(a) == reinterpret_cast<PyTypeObject*>(THPVariableClass)) {  // not Parameter
      const at::Tensor& t = THPVariable_Unpack(a);
      // nested or symbolic sizes throw on sizes(): such a tensor is the Python key's
      if (t.is_nested() || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) Py_RETURN_NONE;
      const int64_t dim = t.dim();
      if (n + 2 * dim + 2 > kMaxWords) Py_RETURN_NONE;
      words[n++] = dim;
      const auto sizes = t.sizes();
      for (int64_t d = 0; d < dim; ++d) words[n++] = sizes[d];
      if (t.layout() == c10::kStrided) {
        const auto strides = t.strides();
        for (int64_t d = 0; d < dim; ++d) words[n++] = strides[d];
      } else {
        for (int64_t d = 0; d < dim; ++d) words[n++] = 0;
      }
      const c10::Device device = t.device();
      words[n++] = static_cast<int64_t>(t.scalar_type()) |
                   (static_cast<int64_t>(device.type()) << 8) |
                   (static_cast<int64_t>(static_cast<uint8_t>(device.index())) << 16) |
                   (static_cast<int64_t>(t.layout()) << 24) |
                   (static_cast<int64_t>(t.requires_grad()) << 32);
    } else if (THPVariable_Check(a)) {
      Py_RETURN_NONE;                      // a tensor subclass: the Python key keeps its type
    } else {
      if (n + 1 > kMaxWords || m + 1 > kMaxValues) Py_RETURN_NONE;
      words[n++] = kValue;
      values[m++] = a;
    }
  }
  if (kwargs != Py_None) {
    Py_ssize_t pos = 0;
    PyObject *name, *value;
    while (PyDict_Next(kwargs, &pos, &name, &value)) {
      // tensors by name go to the Python key, as do more values than the buffer holds
      if (THPVariable_Check(value) || n + 1 > kMaxWords || m + 2 > kMaxValues) Py_RETURN_NONE;
      words[n++] = kNamed;
      values[m++] = name;
      values[m++] = value;
    }
  }
  PyObject* key = PyTuple_New(3);
  if (key == nullptr) return nullptr;
  PyObject* packed = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(words),
                                               n * static_cast<Py_ssize_t>(sizeof(int64_t)));
  PyObject* rest = PyTuple_New(m);
  if (packed == nullptr || rest == nullptr) {
    Py_XDECREF(packed);
    Py_XDECREF(rest);
    Py_DECREF(key);
    return nullptr;
  }
  for (Py_ssize_t j = 0; j < m; ++j) {
    Py_INCREF(values[j]);
    PyTuple_SET_ITEM(rest, j, values[j]);
  }
  PyObject* grad = c10::GradMode::is_enabled() ? Py_True : Py_False;
  Py_INCREF(grad);
  PyTuple_SET_ITEM(key, 0, packed);
  PyTuple_SET_ITEM(key, 1, rest);
  PyTuple_SET_ITEM(key, 2, grad);
  return key;
}

// entry = (cell, fn, n, values, names): cell[0] += 1, then fn(args[0], ..., args[n-1],
// *values), the last len(names) values by those names, as _route.Direct.__call__ does. Returns
// the result, NULL with an error set, or NULL with none where the entry is not laid out so
// (the caller then calls it as Python would).
PyObject* call_direct(PyObject* entry, PyObject* args) {
  constexpr Py_ssize_t kMaxStack = 16;
  if (PyTuple_GET_SIZE(entry) != 5) return nullptr;
  PyObject *cell = PyTuple_GET_ITEM(entry, 0), *fn = PyTuple_GET_ITEM(entry, 1);
  PyObject *count = PyTuple_GET_ITEM(entry, 2), *tail = PyTuple_GET_ITEM(entry, 3);
  PyObject* names = PyTuple_GET_ITEM(entry, 4);
  if (!PyList_Check(cell) || PyList_GET_SIZE(cell) != 1 || !PyLong_CheckExact(count) ||
      !PyTuple_Check(tail) || !PyTuple_CheckExact(names)) {
    return nullptr;
  }
  const Py_ssize_t n = PyLong_AsSsize_t(count), rest = PyTuple_GET_SIZE(tail);
  const Py_ssize_t named = PyTuple_GET_SIZE(names);
  if (n < 0 || n > PyTuple_GET_SIZE(args) || n + rest > kMaxStack || named > rest) {
    PyErr_Clear();
    return nullptr;
  }
  PyObject* stack[kMaxStack];
  for (Py_ssize_t i = 0; i < n; ++i) stack[i] = PyTuple_GET_ITEM(args, i);
  for (Py_ssize_t i = 0; i < rest; ++i) stack[n + i] = PyTuple_GET_ITEM(tail, i);
  PyObject* one = PyLong_FromLong(1);
  PyObject* counted = one == nullptr ? nullptr : PyNumber_Add(PyList_GET_ITEM(cell, 0), one);
  Py_XDECREF(one);
  if (counted == nullptr) return nullptr;
  if (PyList_SetItem(cell, 0, counted) < 0) return nullptr;   // steals counted, drops the old
  return PyObject_Vectorcall(fn, stack, static_cast<size_t>(n + rest - named),
                             named > 0 ? names : nullptr);
}

PyObject* call(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 4 || !PyDict_Check(argv[0]) || !PyTuple_Check(argv[2]) ||
      (argv[3] != Py_None && !PyDict_Check(argv[3]))) {
    PyErr_SetString(PyExc_TypeError, "call(table: dict, miss, args: tuple, kwargs: dict|None)");
    return nullptr;
  }
  PyObject *table = argv[0], *miss = argv[1], *args = argv[2], *kwargs = argv[3];
  PyObject* key = make_key(args, kwargs);
  if (key == nullptr) return nullptr;
  PyObject* entry = nullptr;
  if (key != Py_None) {
    entry = PyDict_GetItemWithError(table, key);   // borrowed
    if (entry != nullptr) {
      Py_INCREF(entry);
    } else if (PyErr_Occurred()) {
      Py_DECREF(key);
      return nullptr;
    }
  }
  if (entry == nullptr) {
    entry = PyObject_CallFunctionObjArgs(miss, args, kwargs, key, nullptr);
    if (entry == nullptr) {
      Py_DECREF(key);
      return nullptr;
    }
  }
  Py_DECREF(key);
  if (PyTuple_Check(entry)) {             // a counted fallback called directly (_route.Direct)
    PyObject* out = call_direct(entry, args);
    if (out != nullptr || PyErr_Occurred()) {
      Py_DECREF(entry);
      return out;
    }
  }
  PyObject* out = PyObject_Call(entry, args,
                                (kwargs != Py_None && PyDict_GET_SIZE(kwargs) > 0) ? kwargs
                                                                                   : nullptr);
  Py_DECREF(entry);
  return out;
}

PyMethodDef kMethods[] = {
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(call)),
     METH_FASTCALL, "call(table, miss, args, kwargs): one eager attention() call"},
    {nullptr, nullptr, 0, nullptr}};

#define EVOATTN_STR2(x) #x
#define EVOATTN_STR(x) EVOATTN_STR2(x)
#define EVOATTN_CAT2(a, b) a##b
#define EVOATTN_CAT(a, b) EVOATTN_CAT2(a, b)

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, EVOATTN_STR(TORCH_EXTENSION_NAME), nullptr, -1,
                       kMethods};

}  // namespace

PyMODINIT_FUNC EVOATTN_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  return PyModule_Create(&kModule);
}
