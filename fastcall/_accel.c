/* fastcall's C wrapper: `FastWrapper`, the object a wrapped function is where this extension
 * is built. It holds no rule of its own: it enters the two hit routes, each one source
 * compiled by Cython, through their C entries, with the call's own argument array (no tuple,
 * no dict, no Python call), and hands any call they decline to the Python wrapper.
 *
 * A call with positional arguments only first goes to the fast route
 * (fastcall/_fast_route.py: `f(first, *arrays)` from the call plan in first's slot); a call it
 * declines, and any call with keyword arguments, to the structure route
 * (fastcall/_structure_route.py: arguments of structures the function has run). Where a route
 * was not compiled, it is called as a Python object. What either declines goes to
 * `fallback`, the Python wrapper's miss (`_dispatch.make_wrapper`), which runs the general
 * path without trying the routes again.
 * FASTCALL_CHECK_HITS=1 (fastcall/_agreement.py) checks every call served against the general
 * path.
 *
 * This module is an optional accelerator: if it fails to build or import, fastcall behaves
 * identically (the Python wrapper calls the same routes), only slower.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* A route's C entry: `SERVE` of fastcall/_fast_route.py (kwnames unused) or of
 * fastcall/_structure_route.py (kwnames: None without keywords). A new reference to the
 * output, to DECLINED, or NULL with an error set. */
typedef PyObject *(*fast_serve_fn)(PyObject *route, PyObject *const *args, Py_ssize_t nargs);
typedef PyObject *(*structure_serve_fn)(PyObject *route, PyObject *const *args, Py_ssize_t nargs,
                                        PyObject *kwnames);

/* Set once by `configure` */
static struct {
    fast_serve_fn serve_fast;           /* NULL: the fast route runs as Python */
    structure_serve_fn serve_structure; /* NULL: the structure route runs as Python */
    PyObject *declined;                 /* what a route returns for a call it does not serve */
} G;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback;  /* the Python wrapper's miss: the general path */
    PyObject *fast;      /* the fast route (_fast_route.FastRoute) */
    PyObject *structure; /* the structure route (_structure_route.StructureRoute) */
    PyObject *dict;
    PyObject *weakreflist;
} FastWrapper;

#if defined(__GNUC__) || defined(__clang__)
#define COLD __attribute__((cold, noinline))
#else
#define COLD
#endif

COLD static PyObject *
fw_fallback(FastWrapper *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

/* A route's answer: the output (or NULL: an error) it gives; 0 in `*served` where it declined. */
static PyObject *
answered(PyObject *out, int *served)
{
    *served = out != G.declined;
    if (!*served) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *
fw_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    FastWrapper *self = (FastWrapper *)op;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    int served;
    PyObject *out;
    if (nargs == 0) {
        return fw_fallback(self, args, nargsf, kwnames);
    }
    if (kwnames == NULL) { /* (the fast route takes positional arguments only) */
        out = G.serve_fast != NULL ? G.serve_fast(self->fast, args, nargs)
                                   : PyObject_Vectorcall(self->fast, args, nargs, NULL);
        if (out == NULL || (out = answered(out, &served), served)) {
            return out;
        }
    }
    out = G.serve_structure != NULL ? G.serve_structure(self->structure, args, nargs, kwnames ? kwnames : Py_None)
                                    : PyObject_Vectorcall(self->structure, args, nargsf, kwnames);
    if (out == NULL || (out = answered(out, &served), served)) {
        return out;
    }
    return fw_fallback(self, args, nargsf, kwnames);
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
    Py_VISIT(self->fast);
    Py_VISIT(self->structure);
    Py_VISIT(self->dict);
    return 0;
}

static int
fw_clear(PyObject *op)
{
    FastWrapper *self = (FastWrapper *)op;
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->fast);
    Py_CLEAR(self->structure);
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

/* The pointer a route's `SERVE` capsule carries (NULL for None: that route runs as Python);
 * 0, or -1 with an error set. */
static int
entry_of(PyObject *capsule, const char *name, void **entry)
{
    *entry = NULL;
    if (capsule == Py_None) {
        return 0;
    }
    *entry = PyCapsule_GetPointer(capsule, name);
    return *entry == NULL ? -1 : 0;
}

/* configure(serve_fast, serve_structure, declined): the routes' C entries (capsules, or None)
 * and what they return for a call they decline. */
static PyObject *
py_configure(PyObject *module, PyObject *args)
{
    PyObject *fast, *structure, *declined;
    void *fast_entry, *structure_entry;
    if (!PyArg_UnpackTuple(args, "configure", 3, 3, &fast, &structure, &declined)
        || entry_of(fast, "fastcall._fast_route.SERVE", &fast_entry) < 0
        || entry_of(structure, "fastcall._structure_route.SERVE", &structure_entry) < 0) {
        return NULL;
    }
    G.serve_fast = (fast_serve_fn)fast_entry;
    G.serve_structure = (structure_serve_fn)structure_entry;
    Py_INCREF(declined);
    Py_XSETREF(G.declined, declined);
    Py_RETURN_NONE;
}

/* FastWrapper(fallback, fast, structure), once `configure` has run. */
static PyObject *
fw_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *fallback, *fast, *structure;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "FastWrapper takes positional arguments only");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "FastWrapper", 3, 3, &fallback, &fast, &structure)) {
        return NULL;
    }
    if (G.declined == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "FastWrapper: fastcall._accel.configure has not been called");
        return NULL;
    }
    FastWrapper *self = (FastWrapper *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = fw_vectorcall;
    self->fallback = Py_NewRef(fallback);
    self->fast = Py_NewRef(fast);
    self->structure = Py_NewRef(structure);
    self->dict = NULL;
    self->weakreflist = NULL;
    return (PyObject *)self;
}

static PyMemberDef fw_members[] = {
    {"fast", T_OBJECT, offsetof(FastWrapper, fast), READONLY, "the fast route, tried first"},
    {"structure", T_OBJECT, offsetof(FastWrapper, structure), READONLY, "the structure route, tried next"},
    {NULL},
};

static PyGetSetDef fw_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyTypeObject FastWrapperType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fastcall._accel.FastWrapper",
    .tp_doc = "A fastcall.jit-wrapped function (C entry to its hit routes).",
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

static PyMethodDef accel_methods[] = {
    {"configure", py_configure, METH_VARARGS, "Set the hit routes' C entries every FastWrapper calls."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef accel_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fastcall._accel",
    .m_doc = "Optional C entry to fastcall's hit routes.",
    .m_size = -1,
    .m_methods = accel_methods,
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
