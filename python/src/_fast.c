/* kiln._fast: the one path from a Python op call to libkiln's C op.
 *
 * kiln.ops calls call(op, runtime, stream, *arrays, *scalars). Each array becomes a kiln_tensor
 * on the C stack: torch tensors are read here, through the C functions of their methods (looked
 * up once per type), every other array through kiln._arrays.describe (NumPy, DLPack,
 * __cuda_array_interface__, __array_interface__), which also raises for what kiln cannot read.
 * Then the launch stream is chosen as kiln._arrays.launch_stream does, and the C op is called
 * with the GIL released (the first call of a shape may compile for seconds). A non-zero
 * kiln_code raises through kiln._lib.raise_for: the same exceptions as every other kiln call.
 *
 * Built against the stable ABI of CPython 3.10 (Py_LIMITED_API; METH_FASTCALL is in it from
 * 3.10), so one abi3 wheel serves every CPython from 3.10 on. No torch headers: a torch tensor's
 * methods are builtin methods, and the stable ABI hands out their C function and flags
 * (PyCFunction_GetFunction, PyCFunction_GetFlags), which are called as CPython calls them.
 * libkiln's functions come as addresses from the ctypes handle kiln._lib loaded (KILN_LIBRARY
 * included), so this module links against nothing.
 */
#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "kiln/kiln.h"

#define MAX_ARRAYS 16
#define MAX_SCALARS 8
#define MAX_RANK 8
#define MAX_TYPES 16
#define MAX_OPS 256

/* Ids 0 and 1 are built in: READ only reads the arrays and returns the launch stream (for tests
 * and the host-overhead benchmark); WORKSPACE_ELEMENTS is kiln_rms_norm_backward_workspace_elements
 * on one array. Every other id is an op registered by kiln.ops from its declaration (kiln/op.h):
 * the kiln_op handle, its tensor count and the kind of each scalar ('d' f64, 'l' the rest). */
enum { OP_READ, OP_WORKSPACE_ELEMENTS, OP_FIRST_DECLARED };

typedef const kiln_tensor* T;
typedef kiln_runtime* R;
typedef kiln_code (*op_call_fn)(R, const kiln_op*, const kiln_tensor* const*, int32_t, const kiln_value*, int32_t,
                                void*);
typedef kiln_code (*workspace_elements_fn)(T, int64_t*);

static struct {
  const kiln_op* op;
  int arrays;
  char scalars[MAX_SCALARS + 1];
} ops[MAX_OPS];
static int n_ops = OP_FIRST_DECLARED;
static op_call_fn op_call;
static workspace_elements_fn workspace_elements;

/* Python hooks, set once by init(). */
static PyObject* py_describe;      /* _arrays.describe(a, stream) -> description tuple */
static PyObject* py_handler_for;   /* _arrays.handler_for(type) -> handler */
static PyObject* py_torch_handler; /* _arrays._torch */
static PyObject* py_torch_dtypes;  /* _arrays.torch_dtype_table() -> {torch.dtype: code} */
static PyObject* py_torch_stream;  /* _arrays.torch_stream_function() -> f(index) -> raw stream */
static PyObject* py_torch_hint;    /* _arrays._TORCH_STREAM */
static PyObject* py_as_stream;     /* _arrays.as_stream */
static PyObject* py_raise_for;     /* _lib.raise_for(code), raises */
static PyObject* py_shape_error;   /* ShapeMismatchError */

static PyObject *s_dtype, *s_shape, *s_handle, *s_data_ptr, *s_get_device, *s_stride;
static PyObject* empty_tuple;

/* A method of a torch type, as CPython would call it on an instance. */
typedef struct {
  PyCFunction fn; /* NULL: call by name */
  int flags;
  PyObject* name;
} Method;

typedef struct {
  PyTypeObject* type; /* a strong reference */
  Method data_ptr, get_device, stride;
} TorchType;

static TorchType torch_types[MAX_TYPES];
static int n_torch_types;
static PyTypeObject* other_types[MAX_TYPES]; /* types whose handler is not _torch */
static int n_other_types;

static PyObject* torch_dtype_obj[6];
static int torch_dtype_code[6];
static int n_torch_dtypes = -1; /* -1: not fetched yet */

static Method stream_fn; /* torch's current raw stream of a device index */
static PyObject* stream_callable;

static void method_from(Method* m, PyObject* instance, PyObject* name) {
  m->fn = NULL;
  m->flags = 0;
  m->name = name;
  PyObject* bound = PyObject_GetAttr(instance, name);
  if (!bound) {
    PyErr_Clear();
    return;
  }
  if (PyCFunction_Check(bound) && PyCFunction_GetSelf(bound) == instance) {
    int flags = PyCFunction_GetFlags(bound) & ~METH_COEXIST;
    if (flags == METH_NOARGS || flags == (METH_VARARGS | METH_KEYWORDS) || flags == METH_VARARGS) {
      m->fn = PyCFunction_GetFunction(bound);
      m->flags = flags;
    }
  }
  Py_DECREF(bound);
}

static PyObject* method_call(const Method* m, PyObject* self) {
  if (m->fn == NULL) return PyObject_CallMethodObjArgs(self, m->name, NULL);
  if (m->flags == METH_NOARGS) return m->fn(self, NULL);
  if (m->flags == METH_VARARGS) return m->fn(self, empty_tuple);
  return ((PyCFunctionWithKeywords)(void (*)(void))m->fn)(self, empty_tuple, NULL);
}

static int fetch_torch_dtypes(void) {
  PyObject* table = PyObject_CallNoArgs(py_torch_dtypes);
  if (!table) return -1;
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  int n = 0;
  while (n < 6 && PyDict_Next(table, &pos, &key, &value)) {
    Py_INCREF(key);
    torch_dtype_obj[n] = key;
    torch_dtype_code[n] = (int)PyLong_AsLong(value);
    n++;
  }
  Py_DECREF(table);
  n_torch_dtypes = n;
  return 0;
}

static PyObject* call1(PyObject* fn, PyObject* arg) { return PyObject_CallFunctionObjArgs(fn, arg, NULL); }

/* The torch entry of a's type; NULL without an error: not a torch tensor; NULL with one: failed. */
static const TorchType* torch_type_of(PyObject* a) {
  PyTypeObject* tp = Py_TYPE(a);
  for (int i = 0; i < n_torch_types; i++)
    if (torch_types[i].type == tp) return &torch_types[i];
  for (int i = 0; i < n_other_types; i++)
    if (other_types[i] == tp) return NULL;
  PyObject* handler = call1(py_handler_for, (PyObject*)tp);
  if (!handler) return NULL;
  int is_torch = handler == py_torch_handler;
  Py_DECREF(handler);
  if (!is_torch) {
    if (n_other_types < MAX_TYPES) {  /* past that, types are classified again on each call */
      Py_INCREF(tp);
      other_types[n_other_types++] = tp;
    }
    return NULL;
  }
  if (n_torch_dtypes < 0 && fetch_torch_dtypes() < 0) return NULL;
  TorchType entry;
  entry.type = tp;
  method_from(&entry.data_ptr, a, s_data_ptr);
  method_from(&entry.get_device, a, s_get_device);
  method_from(&entry.stride, a, s_stride);
  for (int i = 0; i < n_torch_types; i++)  /* the lookups ran Python: another thread may have added it */
    if (torch_types[i].type == tp) return &torch_types[i];
  if (n_torch_types == MAX_TYPES) {  /* a full table: this call reads by name */
    static TorchType spare;
    spare = entry;
    spare.data_ptr.fn = spare.get_device.fn = spare.stride.fn = NULL;
    return &spare;
  }
  Py_INCREF(tp);
  torch_types[n_torch_types] = entry;
  return &torch_types[n_torch_types++];
}

/* One array as kiln_tensor: its descriptor with shape and strides in place. */
typedef struct {
  kiln_tensor t;
  int64_t dims[2 * MAX_RANK];
  int rank;
  PyObject* keep;  /* the description from Python (holds DLPack capsules), or NULL */
} Slot;

typedef struct {
  int found;        /* a CUDA array was seen */
  int torch;        /* its stream is torch's current stream of device `index` */
  int index;
  PyObject* hint;   /* borrowed from a description: its stream hint */
} FirstCuda;

static int read_ints(PyObject* seq, int64_t* out, int n) {
  for (int i = 0; i < n; i++) {
    PyObject* item = PySequence_GetItem(seq, i);
    if (!item) return -1;
    out[i] = PyLong_AsLongLong(item);
    Py_DECREF(item);
    if (out[i] == -1 && PyErr_Occurred()) return -1;
  }
  return 0;
}

static int read_tuple_ints(PyObject* tuple, int64_t* out, int n) {
  for (int i = 0; i < n; i++) {
    PyObject* item = PyTuple_GetItem(tuple, i);
    if (!item) return -1;
    out[i] = PyLong_AsLongLong(item);
    if (out[i] == -1 && PyErr_Occurred()) return -1;
  }
  return 0;
}

static void* as_pointer(PyObject* v) {
  if (v == Py_None) return NULL;
  return PyLong_AsVoidPtr(v);
}

/* A torch tensor, read here. 1: done; 0: not handled here (an unsupported dtype: describe()
 * raises for it); -1: error. */
static int read_torch(const TorchType* tt, PyObject* a, Slot* s, FirstCuda* first) {
  PyObject* dtype = PyObject_GetAttr(a, s_dtype);
  if (!dtype) return -1;
  int code = -1;
  for (int i = 0; i < n_torch_dtypes; i++)
    if (torch_dtype_obj[i] == dtype) code = torch_dtype_code[i];
  Py_DECREF(dtype);
  if (code < 0) return 0;
  PyObject* v = method_call(&tt->get_device, a);
  if (!v) return -1;
  long index = PyLong_AsLong(v);
  Py_DECREF(v);
  if (index == -1 && PyErr_Occurred()) return -1;
  v = method_call(&tt->data_ptr, a);
  if (!v) return -1;
  void* data = PyLong_AsVoidPtr(v);
  Py_DECREF(v);
  if (!data && PyErr_Occurred()) return -1;
  PyObject* shape = PyObject_GetAttr(a, s_shape);
  if (!shape) return -1;
  Py_ssize_t rank = PyTuple_Size(shape);
  if (rank < 0 || (rank >= 1 && rank <= MAX_RANK && read_tuple_ints(shape, s->dims, (int)rank) < 0)) {
    Py_DECREF(shape);
    return -1;
  }
  Py_DECREF(shape);
  if (rank >= 1 && rank <= MAX_RANK) {
    PyObject* strides = method_call(&tt->stride, a);
    if (!strides) return -1;
    int bad = PyTuple_Size(strides) != rank || read_tuple_ints(strides, s->dims + MAX_RANK, (int)rank) < 0;
    Py_DECREF(strides);
    if (bad) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "kiln: a tensor's stride() does not match its shape");
      return -1;
    }
  }
  s->rank = (int)rank;
  s->t.data = data;
  s->t.dtype = code;
  s->t.device_kind = index >= 0 ? KILN_CUDA : KILN_CPU;
  s->t.device_index = index >= 0 ? (int32_t)index : 0;
  if (index >= 0 && !first->found) {
    first->found = 1;
    first->torch = 1;
    first->index = (int)index;
  }
  return 1;
}

/* Any array, through _arrays.describe: (ptr, dtype code, shape, strides, device kind, device
 * index, stream hint, keep-alive). */
static int read_described(PyObject* a, PyObject* stream, Slot* s, FirstCuda* first) {
  PyObject* d = PyObject_CallFunctionObjArgs(py_describe, a, stream, NULL);
  if (!d) return -1;
  s->keep = d;
  if (!PyTuple_Check(d) || PyTuple_Size(d) != 8) {
    PyErr_SetString(PyExc_TypeError, "kiln: a handler returned a malformed description");
    return -1;
  }
  void* data = as_pointer(PyTuple_GetItem(d, 0));
  if (!data && PyErr_Occurred()) return -1;
  long code = PyLong_AsLong(PyTuple_GetItem(d, 1));
  long kind = PyLong_AsLong(PyTuple_GetItem(d, 4));
  long index = PyLong_AsLong(PyTuple_GetItem(d, 5));
  if (PyErr_Occurred()) return -1;
  PyObject* shape = PyTuple_GetItem(d, 2);
  Py_ssize_t rank = PySequence_Size(shape);
  if (rank < 0) return -1;
  if (rank >= 1 && rank <= MAX_RANK) {
    if (read_ints(shape, s->dims, (int)rank) < 0 || read_ints(PyTuple_GetItem(d, 3), s->dims + MAX_RANK, (int)rank) < 0)
      return -1;
  }
  s->rank = (int)rank;
  s->t.data = data;
  s->t.dtype = (int32_t)code;
  s->t.device_kind = (int32_t)kind;
  s->t.device_index = (int32_t)index;
  if (kind == KILN_CUDA && !first->found) {
    PyObject* hint = PyTuple_GetItem(d, 6);
    first->found = 1;
    first->torch = hint == py_torch_hint;
    first->index = (int)index;
    first->hint = hint;
  }
  return 1;
}

static int torch_stream(int index, void** out) {
  if (!stream_callable) {
    PyObject* f = PyObject_CallNoArgs(py_torch_stream);
    if (!f) return -1;
    stream_fn.fn = NULL;
    stream_fn.name = NULL;
    if (PyCFunction_Check(f) && (PyCFunction_GetFlags(f) & ~METH_COEXIST) == METH_O) {
      stream_fn.fn = PyCFunction_GetFunction(f);
      stream_fn.flags = METH_O;
    }
    stream_callable = f;
  }
  PyObject* i = PyLong_FromLong(index);
  if (!i) return -1;
  PyObject* v = stream_fn.fn ? stream_fn.fn(PyCFunction_GetSelf(stream_callable), i) : call1(stream_callable, i);
  Py_DECREF(i);
  if (!v) return -1;
  *out = PyLong_AsVoidPtr(v);
  Py_DECREF(v);
  return (!*out && PyErr_Occurred()) ? -1 : 0;
}

/* The stream handle from the stream= argument (an int or a stream object). */
static int explicit_stream(PyObject* stream, void** out) {
  if (PyLong_Check(stream)) {
    *out = PyLong_AsVoidPtr(stream);
    return (!*out && PyErr_Occurred()) ? -1 : 0;
  }
  PyObject* v = call1(py_as_stream, stream);
  if (!v) return -1;
  *out = PyLong_AsVoidPtr(v);
  Py_DECREF(v);
  return (!*out && PyErr_Occurred()) ? -1 : 0;
}

static kiln_code run_op(int op, R rt, Slot* slots, const int* present, const kiln_value* values, void* stream,
                        int64_t* result) {
  if (op == OP_WORKSPACE_ELEMENTS) return workspace_elements(present[0] ? &slots[0].t : NULL, result);
  const kiln_tensor* tensors[MAX_ARRAYS];
  const int n = ops[op].arrays;
  for (int k = 0; k < n; k++) tensors[k] = present[k] ? &slots[k].t : NULL;
  return op_call(rt, ops[op].op, tensors, n, values, (int32_t)strlen(ops[op].scalars), stream);
}

/* call(op, runtime, stream, *arrays, *scalars) */
static PyObject* fast_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs < 3) {
    PyErr_SetString(PyExc_TypeError, "call(op, runtime, stream, *arrays, *scalars)");
    return NULL;
  }
  long op = PyLong_AsLong(args[0]);
  if (op < 0 || op >= n_ops || (op == OP_WORKSPACE_ELEMENTS && !workspace_elements) ||
      (op >= OP_FIRST_DECLARED && !op_call)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "kiln._fast.call: unknown op");
    return NULL;
  }
  const char* scalars = op >= OP_FIRST_DECLARED ? ops[op].scalars : "";
  int n_scalars = (int)strlen(scalars);
  int n = op == OP_READ ? (int)nargs - 3 : op == OP_WORKSPACE_ELEMENTS ? 1 : ops[op].arrays;
  if (n < 0 || n > MAX_ARRAYS || nargs != 3 + n + n_scalars) {
    PyErr_SetString(PyExc_TypeError, "kiln._fast.call: wrong number of arguments for the op");
    return NULL;
  }
  PyObject* stream_arg = args[2];
  Slot slots[MAX_ARRAYS];
  int present[MAX_ARRAYS];
  FirstCuda first = {0, 0, 0, NULL};
  PyObject* result = NULL;
  int k = 0;
  for (; k < n; k++) {
    PyObject* a = args[3 + k];
    Slot* s = &slots[k];
    s->keep = NULL;
    present[k] = a != Py_None;
    if (!present[k]) continue;
    s->t.shape = s->dims;
    s->t.strides = s->dims + MAX_RANK;
    int done = 0;
    const TorchType* tt = torch_type_of(a);
    if (tt) {
      done = read_torch(tt, a, s, &first);
    } else if (PyErr_Occurred()) {
      done = -1;
    }
    if (done == 0) done = read_described(a, stream_arg, s, &first);
    if (done < 0) {
      k++;
      goto out;
    }
    s->t.rank = s->rank;
  }
  /* Ranks: 0-d first, then the first past MAX_RANK, as kiln._arrays has always reported them. */
  for (int j = 0; j < n; j++)
    if (present[j] && slots[j].rank == 0) {
      PyErr_Format(py_shape_error, "kiln takes tensors of rank 1..%d, not 0-d scalars", MAX_RANK);
      goto out;
    }
  for (int j = 0; j < n; j++)
    if (present[j] && slots[j].rank > MAX_RANK) {
      PyErr_Format(py_shape_error, "kiln takes tensors of rank 1..%d, not %d", MAX_RANK, slots[j].rank);
      goto out;
    }
  void* stream = NULL;
  if (op != OP_WORKSPACE_ELEMENTS) {
    int rc = 0;
    if (stream_arg != Py_None) {
      rc = explicit_stream(stream_arg, &stream);
    } else if (first.found) {
      if (first.torch) {
        rc = torch_stream(first.index, &stream);
      } else if (first.hint && first.hint != Py_None && PyObject_IsTrue(first.hint)) {
        stream = PyLong_AsVoidPtr(first.hint);
        rc = (!stream && PyErr_Occurred()) ? -1 : 0;
      }
    }
    if (rc < 0) goto out;
  }
  if (op == OP_READ) {
    result = PyLong_FromVoidPtr(stream);
    goto out;
  }
  R rt = NULL;
  if (args[1] != Py_None) {
    PyObject* h = PyObject_GetAttr(args[1], s_handle);
    if (!h) goto out;
    rt = (R)as_pointer(h);
    Py_DECREF(h);
    if (!rt && PyErr_Occurred()) goto out;
  }
  kiln_value values[MAX_SCALARS];
  for (int j = 0; j < n_scalars; j++) {
    PyObject* v = args[3 + n + j];
    values[j].f64 = 0;
    values[j].i64 = 0;
    if (scalars[j] == 'd') {
      values[j].f64 = PyFloat_AsDouble(v);
    } else {
      values[j].i64 = PyLong_AsLongLong(v);
    }
    if (PyErr_Occurred()) goto out;
  }
  int64_t elements = 0;
  kiln_code code;
  Py_BEGIN_ALLOW_THREADS
  code = run_op((int)op, rt, slots, present, values, stream, &elements);
  Py_END_ALLOW_THREADS
  if (code != KILN_OK) {
    PyObject* c = PyLong_FromLong(code);
    if (c) {
      PyObject* r = call1(py_raise_for, c);  /* raises */
      Py_XDECREF(r);
      Py_DECREF(c);
    }
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "kiln: raise_for returned");
    goto out;
  }
  if (op == OP_WORKSPACE_ELEMENTS) {
    result = PyLong_FromLongLong(elements);
  } else {
    Py_INCREF(Py_None);
    result = Py_None;
  }
out:
  for (int j = 0; j < k; j++)
    if (present[j]) Py_XDECREF(slots[j].keep);
  return result;
}

/* init(kiln_op_call address, kiln_rms_norm_backward_workspace_elements address, describe,
 * handler_for, torch handler, torch dtype table, torch stream function, torch stream hint,
 * as_stream, raise_for, ShapeMismatchError) */
static PyObject* fast_init(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 11) {
    PyErr_SetString(PyExc_TypeError, "kiln._fast.init: wrong arguments");
    return NULL;
  }
  op_call = (op_call_fn)as_pointer(args[0]);
  if (PyErr_Occurred()) return NULL;
  workspace_elements = (workspace_elements_fn)as_pointer(args[1]);
  if (PyErr_Occurred()) return NULL;
  PyObject** hooks[] = {&py_describe, &py_handler_for, &py_torch_handler, &py_torch_dtypes, &py_torch_stream,
                        &py_torch_hint, &py_as_stream, &py_raise_for, &py_shape_error};
  for (int j = 0; j < 9; j++) {
    Py_INCREF(args[2 + j]);
    PyObject* old = *hooks[j];
    *hooks[j] = args[2 + j];
    Py_XDECREF(old);
  }
  Py_INCREF(Py_None);
  return Py_None;
}

/* register(kiln_op address, tensor count, scalar kinds) -> the op's id for call() */
static PyObject* fast_register(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 3 || !PyUnicode_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "kiln._fast.register(op, arrays, scalar_kinds)");
    return NULL;
  }
  const kiln_op* op = (const kiln_op*)as_pointer(args[0]);
  if (!op && PyErr_Occurred()) return NULL;
  long arrays = PyLong_AsLong(args[1]);
  if (arrays == -1 && PyErr_Occurred()) return NULL;
  Py_ssize_t len = 0;
  const char* kinds = PyUnicode_AsUTF8AndSize(args[2], &len);
  if (!kinds) return NULL;
  if (!op || arrays < 1 || arrays > MAX_ARRAYS || len > MAX_SCALARS || strspn(kinds, "dl") != (size_t)len) {
    PyErr_SetString(PyExc_ValueError, "kiln._fast.register: bad op description");
    return NULL;
  }
  for (int i = OP_FIRST_DECLARED; i < n_ops; i++)
    if (ops[i].op == op) return PyLong_FromLong(i);
  if (n_ops == MAX_OPS) {
    PyErr_SetString(PyExc_RuntimeError, "kiln._fast.register: too many ops");
    return NULL;
  }
  ops[n_ops].op = op;
  ops[n_ops].arrays = (int)arrays;
  memcpy(ops[n_ops].scalars, kinds, (size_t)len);
  ops[n_ops].scalars[len] = '\0';
  return PyLong_FromLong(n_ops++);
}

static PyMethodDef methods[] = {
    {"call", (PyCFunction)(void (*)(void))fast_call, METH_FASTCALL,
     "call(op, runtime, stream, *arrays, *scalars): one kiln op (kiln.ops)."},
    {"init", (PyCFunction)(void (*)(void))fast_init, METH_FASTCALL, "Called once by kiln.ops."},
    {"register", (PyCFunction)(void (*)(void))fast_register, METH_FASTCALL,
     "register(op, arrays, scalar_kinds) -> id: an op from its declaration (kiln.ops)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fast", "kiln's op calls in C.", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fast(void) {
  s_dtype = PyUnicode_InternFromString("dtype");
  s_shape = PyUnicode_InternFromString("shape");
  s_handle = PyUnicode_InternFromString("handle");
  s_data_ptr = PyUnicode_InternFromString("data_ptr");
  s_get_device = PyUnicode_InternFromString("get_device");
  s_stride = PyUnicode_InternFromString("stride");
  empty_tuple = PyTuple_New(0);
  if (!s_dtype || !s_shape || !s_handle || !s_data_ptr || !s_get_device || !s_stride || !empty_tuple) return NULL;
  PyObject* m = PyModule_Create(&module);
  if (!m) return NULL;
  if (PyModule_AddIntConstant(m, "READ", OP_READ) < 0 ||
      PyModule_AddIntConstant(m, "WORKSPACE_ELEMENTS", OP_WORKSPACE_ELEMENTS) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
