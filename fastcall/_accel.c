/* The hot path of fastcall.jit in C: `FastWrapper`.
 *
 * It handles the case an inference loop hits every call: every argument but
 * the first is a plain jax array of the exact ArrayImpl type, and the first is
 *  - an object in fastcall's identity cache (same object, checked through its
 *    weakref) with a "bound" record for this wrapped function: the compiled
 *    function (a functools.partial with the object's leaves already bound) is
 *    called on the remaining arguments; or
 *  - an NNX object whose cached structure is still valid, with a bound record:
 *    its Variables' values are read through the _raw_value slot and passed
 *    with the remaining arguments; changed state is written back by the
 *    post_nnx function.
 * Then the post-processing function is applied if there is one.
 *
 * Everything else (keyword arguments, a cache miss, a new structure, a
 * tracer, NNX objects, ...) goes to `fallback`, the pure-Python wrapper in
 * _jit.py, which holds all the logic. The Python wrapper implements the same
 * fast case, so this module is an optional accelerator: if it fails to build
 * or import, fastcall behaves identically, only ~0.5 us slower per call.
 *
 * Layout of an identity-cache entry (see _flatten.py):
 *   by_id[id(obj)] = (ref, leaves, spec_id, bound, spec)
 *   bound[state]   = (nargs, call, post_or_None)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback;    /* the Python wrapper: handles every other case */
    PyObject *by_id;       /* dict: id(obj) -> entry tuple */
    PyObject *state;       /* key of this wrapped function in entry[3] */
    PyObject *array_type;  /* jaxlib ArrayImpl */
    PyObject *varies_exc;  /* _StructureVaries: retry through the fallback */
    PyObject *on_error;    /* on_error(exception, args): re-raises it, made clearer */
    PyObject *nnx_fast;    /* dict: id(nnx object) -> (ref, variables, bound) */
    PyObject *raw_desc;    /* the Variable._raw_value slot descriptor */
    Py_ssize_t calls;      /* calls served here (added to JitStats.calls) */
    PyObject *dict;
    PyObject *weakreflist;
} FastWrapper;

static PyObject *
fw_fallback(FastWrapper *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

/* After a failed call of the compiled function: retry through the fallback for
 * _StructureVaries, otherwise hand the exception to on_error (which re-raises it,
 * translated when it is an eqx.error_if failure). Always returns NULL or the
 * fallback's result. */
static PyObject *
fw_failed(FastWrapper *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    self->calls--;
    if (PyErr_ExceptionMatches(self->varies_exc)) {
        PyErr_Clear();
        return fw_fallback(self, args, nargsf, kwnames);
    }
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) {
        PyException_SetTraceback(value, tb);
    }
    PyObject *res = NULL;
    if (value != NULL) {
        PyObject *argtuple = PyTuple_New(PyVectorcall_NARGS(nargsf));
        if (argtuple != NULL) {
            for (Py_ssize_t i = 0; i < PyVectorcall_NARGS(nargsf); i++) {
                Py_INCREF(args[i]);
                PyTuple_SET_ITEM(argtuple, i, args[i]);
            }
            res = PyObject_CallFunctionObjArgs(self->on_error, value, argtuple, NULL);
            Py_DECREF(argtuple);
        }
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (res != NULL) { /* on_error must raise; be safe if it does not */
        Py_DECREF(res);
        PyErr_SetString(PyExc_RuntimeError, "fastcall: error handler returned");
    }
    return NULL;
}

#define SMALL_STACK 64

/* The NNX case: the first argument is an NNX object whose cached structure is
 * still valid (it is in nnx_fast), with a bound record
 * (nargs, fn, post_nnx or None, post or None) for this function. The Variables'
 * current values are read through the _raw_value slot. */
static PyObject *
fw_nnx(FastWrapper *self, PyObject *const *args, size_t nargsf, PyObject *kwnames, PyObject *key)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *first = args[0];
    PyObject *rec = PyDict_GetItemWithError(self->nnx_fast, key); /* borrowed */
    if (rec == NULL || !PyTuple_CheckExact(rec) || PyTuple_GET_SIZE(rec) != 3) {
        return PyErr_Occurred() ? NULL : fw_fallback(self, args, nargsf, kwnames);
    }
    PyObject *ref = PyTuple_GET_ITEM(rec, 0);
    PyObject *items = PyTuple_GET_ITEM(rec, 1);
    PyObject *bound_map = PyTuple_GET_ITEM(rec, 2);
    if (!PyWeakref_CheckRef(ref) || PyWeakref_GET_OBJECT(ref) != first || !PyList_CheckExact(items)
        || !PyDict_CheckExact(bound_map)) {
        return fw_fallback(self, args, nargsf, kwnames);
    }
    PyObject *bound = PyDict_GetItemWithError(bound_map, self->state); /* borrowed */
    if (bound == NULL || !PyTuple_CheckExact(bound) || PyTuple_GET_SIZE(bound) != 4) {
        return PyErr_Occurred() ? NULL : fw_fallback(self, args, nargsf, kwnames);
    }
    Py_ssize_t expected = PyLong_AsSsize_t(PyTuple_GET_ITEM(bound, 0));
    if (expected != nargs) {
        return (expected == -1 && PyErr_Occurred()) ? NULL : fw_fallback(self, args, nargsf, kwnames);
    }
    for (Py_ssize_t i = 1; i < nargs; i++) {
        if ((PyObject *)Py_TYPE(args[i]) != self->array_type) {
            return fw_fallback(self, args, nargsf, kwnames);
        }
    }
    /* Hold what we use: another thread may replace the records during the call. */
    Py_INCREF(bound);
    Py_INCREF(items);
    Py_ssize_t nvars = PyList_GET_SIZE(items);
    Py_ssize_t total = nvars + nargs - 1;
    PyObject *small[SMALL_STACK];
    PyObject **stack = total <= SMALL_STACK ? small : PyMem_Malloc(total * sizeof(PyObject *));
    PyObject *out = NULL;
    Py_ssize_t filled = 0;
    if (stack == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    descrgetfunc get = Py_TYPE(self->raw_desc)->tp_descr_get;
    for (; filled < nvars; filled++) {
        PyObject *var = PyList_GET_ITEM(items, filled);
        PyObject *value = get(self->raw_desc, var, (PyObject *)Py_TYPE(var));
        if (value == NULL) {
            goto done;
        }
        stack[filled] = value;
    }
    if (nvars > 0 && (PyObject *)Py_TYPE(stack[0]) != self->array_type) {
        /* tracers (inside an nnx transform) or another kind of value: slow path */
        for (Py_ssize_t i = 0; i < filled; i++) Py_DECREF(stack[i]);
        filled = 0;
        if (stack != small) PyMem_Free(stack);
        stack = NULL;
        Py_DECREF(bound);
        Py_DECREF(items);
        return fw_fallback(self, args, nargsf, kwnames);
    }
    for (Py_ssize_t i = 1; i < nargs; i++) {
        stack[nvars + i - 1] = args[i]; /* borrowed: not decref'd below */
    }
    self->calls++;
    out = PyObject_Vectorcall(PyTuple_GET_ITEM(bound, 1), stack, total, NULL);
    if (out == NULL) {
        for (Py_ssize_t i = 0; i < filled; i++) Py_DECREF(stack[i]);
        filled = 0;
        if (stack != small) PyMem_Free(stack);
        stack = NULL;
        Py_DECREF(bound);
        Py_DECREF(items);
        return fw_failed(self, args, nargsf, kwnames);
    }
    PyObject *post_nnx = PyTuple_GET_ITEM(bound, 2);
    PyObject *post = PyTuple_GET_ITEM(bound, 3);
    if (post_nnx != Py_None) {
        PyObject *refs = Py_BuildValue("[(OO)]", first, items);
        PyObject *result = refs ? PyObject_CallFunctionObjArgs(post_nnx, out, refs, NULL) : NULL;
        Py_XDECREF(refs);
        Py_DECREF(out);
        out = result;
    } else if (post != Py_None) {
        PyObject *result = PyObject_CallOneArg(post, out);
        Py_DECREF(out);
        out = result;
    }
done:
    for (Py_ssize_t i = 0; i < filled; i++) Py_DECREF(stack[i]);
    if (stack != NULL && stack != small) PyMem_Free(stack);
    Py_DECREF(bound);
    Py_DECREF(items);
    return out;
}

static PyObject *
fw_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    FastWrapper *self = (FastWrapper *)op;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL || nargs == 0) {
        return fw_fallback(self, args, nargsf, kwnames);
    }
    PyObject *first = args[0];
    PyObject *key = PyLong_FromVoidPtr(first);
    if (key == NULL) {
        return NULL;
    }
    PyObject *hit = PyDict_GetItemWithError(self->by_id, key); /* borrowed */
    if (hit == NULL) {
        if (PyErr_Occurred()) {
            Py_DECREF(key);
            return NULL;
        }
        PyObject *res = fw_nnx(self, args, nargsf, kwnames, key);
        Py_DECREF(key);
        return res;
    }
    Py_DECREF(key);
    if (!PyTuple_CheckExact(hit) || PyTuple_GET_SIZE(hit) < 4) {
        return fw_fallback(self, args, nargsf, kwnames);
    }
    PyObject *ref = PyTuple_GET_ITEM(hit, 0);
    if (!PyWeakref_CheckRef(ref) || PyWeakref_GET_OBJECT(ref) != first) {
        return fw_fallback(self, args, nargsf, kwnames);
    }
    PyObject *bound_map = PyTuple_GET_ITEM(hit, 3);
    if (!PyDict_CheckExact(bound_map)) {
        return fw_fallback(self, args, nargsf, kwnames);
    }
    PyObject *bound = PyDict_GetItemWithError(bound_map, self->state); /* borrowed */
    if (bound == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        return fw_fallback(self, args, nargsf, kwnames);
    }
    if (!PyTuple_CheckExact(bound) || PyTuple_GET_SIZE(bound) != 3) {
        return fw_fallback(self, args, nargsf, kwnames);
    }
    Py_ssize_t expected = PyLong_AsSsize_t(PyTuple_GET_ITEM(bound, 0));
    if (expected != nargs) {
        if (expected == -1 && PyErr_Occurred()) {
            return NULL;
        }
        return fw_fallback(self, args, nargsf, kwnames);
    }
    for (Py_ssize_t i = 1; i < nargs; i++) {
        if ((PyObject *)Py_TYPE(args[i]) != self->array_type) {
            return fw_fallback(self, args, nargsf, kwnames);
        }
    }
    /* The bound record may be replaced by another thread during the call. */
    Py_INCREF(bound);
    self->calls++;
    PyObject *out = PyObject_Vectorcall(PyTuple_GET_ITEM(bound, 1), args + 1, nargs - 1, NULL);
    if (out == NULL) {
        Py_DECREF(bound);
        return fw_failed(self, args, nargsf, kwnames);
    }
    PyObject *post = PyTuple_GET_ITEM(bound, 2);
    if (post != Py_None) {
        PyObject *result = PyObject_CallOneArg(post, out);
        Py_DECREF(out);
        out = result;
    }
    Py_DECREF(bound);
    return out;
}

static PyObject *
fw_call(PyObject *op, PyObject *args, PyObject *kwargs)
{
    return PyVectorcall_Call(op, args, kwargs);
}

static PyObject *
fw_descr_get(PyObject *op, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(op);
        return op;
    }
    return PyMethod_New(op, obj);
}

static int
fw_traverse(PyObject *op, visitproc visit, void *arg)
{
    FastWrapper *self = (FastWrapper *)op;
    Py_VISIT(self->fallback);
    Py_VISIT(self->by_id);
    Py_VISIT(self->state);
    Py_VISIT(self->array_type);
    Py_VISIT(self->varies_exc);
    Py_VISIT(self->on_error);
    Py_VISIT(self->nnx_fast);
    Py_VISIT(self->raw_desc);
    Py_VISIT(self->dict);
    return 0;
}

static int
fw_clear(PyObject *op)
{
    FastWrapper *self = (FastWrapper *)op;
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->by_id);
    Py_CLEAR(self->state);
    Py_CLEAR(self->array_type);
    Py_CLEAR(self->varies_exc);
    Py_CLEAR(self->on_error);
    Py_CLEAR(self->nnx_fast);
    Py_CLEAR(self->raw_desc);
    Py_CLEAR(self->dict);
    return 0;
}

static void
fw_dealloc(PyObject *op)
{
    FastWrapper *self = (FastWrapper *)op;
    PyObject_GC_UnTrack(op);
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs(op);
    }
    fw_clear(op);
    Py_TYPE(op)->tp_free(op);
}

static PyObject *
fw_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *fallback, *by_id, *state, *array_type, *varies_exc, *on_error, *nnx_fast, *raw_desc;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "FastWrapper takes positional arguments only");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "FastWrapper", 8, 8, &fallback, &by_id, &state, &array_type,
                           &varies_exc, &on_error, &nnx_fast, &raw_desc)) {
        return NULL;
    }
    if (!PyDict_CheckExact(by_id) || !PyDict_CheckExact(nnx_fast)) {
        PyErr_SetString(PyExc_TypeError, "by_id and nnx_fast must be dicts");
        return NULL;
    }
    if (Py_TYPE(raw_desc)->tp_descr_get == NULL) {
        PyErr_SetString(PyExc_TypeError, "raw_desc must be a descriptor");
        return NULL;
    }
    FastWrapper *self = (FastWrapper *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = fw_vectorcall;
    Py_INCREF(fallback); self->fallback = fallback;
    Py_INCREF(by_id); self->by_id = by_id;
    Py_INCREF(state); self->state = state;
    Py_INCREF(array_type); self->array_type = array_type;
    Py_INCREF(varies_exc); self->varies_exc = varies_exc;
    Py_INCREF(on_error); self->on_error = on_error;
    Py_INCREF(nnx_fast); self->nnx_fast = nnx_fast;
    Py_INCREF(raw_desc); self->raw_desc = raw_desc;
    self->calls = 0;
    self->dict = NULL;
    self->weakreflist = NULL;
    return (PyObject *)self;
}

static PyMemberDef fw_members[] = {
    {"_fastcall_c_calls", T_PYSSIZET, offsetof(FastWrapper, calls), READONLY, "calls served in C"},
    {NULL},
};

static PyGetSetDef fw_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyTypeObject FastWrapperType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fastcall._accel.FastWrapper",
    .tp_doc = "A fastcall.jit-wrapped function (C fast path).",
    .tp_basicsize = sizeof(FastWrapper),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL
                | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = fw_new,
    .tp_dealloc = fw_dealloc,
    .tp_traverse = fw_traverse,
    .tp_clear = fw_clear,
    .tp_call = fw_call,
    .tp_descr_get = fw_descr_get,
    .tp_vectorcall_offset = offsetof(FastWrapper, vectorcall),
    .tp_dictoffset = offsetof(FastWrapper, dict),
    .tp_weaklistoffset = offsetof(FastWrapper, weakreflist),
    .tp_members = fw_members,
    .tp_getset = fw_getset,
};

static struct PyModuleDef accel_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fastcall._accel",
    .m_doc = "Optional C fast path for fastcall.jit.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__accel(void)
{
    if (PyType_Ready(&FastWrapperType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&accel_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&FastWrapperType);
    if (PyModule_AddObject(m, "FastWrapper", (PyObject *)&FastWrapperType) < 0) {
        Py_DECREF(&FastWrapperType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
