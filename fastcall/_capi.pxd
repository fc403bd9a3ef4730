# What fastcall's compiled modules (setup.py's COMPILED_SOURCES) use of CPython's C API that
# Cython's own declarations lack. Read by Cython only, at build time.
from cpython.object cimport PyObject

cdef extern from "Python.h":
    object PyObject_Vectorcall(object callable, PyObject **args, size_t nargsf, PyObject *kwnames)

# A call's arguments as the C wrapper passes them to a hit route (`PyObject *const *`), and
# the i-th of them (run as Python, the routes take a tuple and index it)
ctypedef PyObject **Argv

cdef inline object arg(Argv argv, Py_ssize_t i):
    return <object>argv[i]

cdef extern from *:
    """
    /* A dict's version tag (PEP 509): changed by every operation that changes what the dict
     * holds, never shared by two states of one dict; trusted for plain dicts (a combined
     * table). Deprecated since 3.12 and gone in 3.14: there (and free-threaded) it reads 0,
     * which callers take as "remember nothing". */
    #if PY_VERSION_HEX < 0x030E0000 && !defined(Py_GIL_DISABLED)
    static inline unsigned long long fastcall_dict_version(PyObject *d) {
    #pragma GCC diagnostic push
    #pragma GCC diagnostic ignored "-Wdeprecated-declarations"
        return (unsigned long long)((PyDictObject *)d)->ma_version_tag;
    #pragma GCC diagnostic pop
    }
    #else
    static inline unsigned long long fastcall_dict_version(PyObject *d) { (void)d; return 0; }
    #endif
    """
    unsigned long long dict_version "fastcall_dict_version" (object d)

cdef extern from *:
    """
    /* The calling thread state's id: unique within the interpreter, never reused. */
    static inline unsigned long long fastcall_thread_id(void) { return (unsigned long long)PyThreadState_Get()->id; }
    /* Whether a dict keeps its own values (a combined table): its version tag then moves with
     * every write (an object's attribute dict may share its values with the object, 3.13+,
     * which writes an attribute there without a new tag). */
    static inline int fastcall_dict_combined(PyObject *d) { return ((PyDictObject *)d)->ma_values == NULL; }
    /* Whether an object's type lets it be weakly referenced. */
    static inline int fastcall_weakrefable(PyObject *o) { return PyType_SUPPORTS_WEAKREFS(Py_TYPE(o)); }
    """
    unsigned long long thread_id "fastcall_thread_id" ()
    bint dict_combined "fastcall_dict_combined" (object d)
    bint weakrefable "fastcall_weakrefable" (object o)


cdef extern from "Python.h":
    object PyObject_GenericGetDict(object o, void *context)

cdef extern from *:
    """
    /* `cls(*fields)` for a NamedTuple class `cls`, made as its own `__new__` makes it
     * (`tuple.__new__(cls, fields)`), through tuple's C slot: no Python call. */
    static inline PyObject *fastcall_new_record(PyObject *cls, PyObject *fields) {
        PyObject *args = PyTuple_Pack(1, fields);
        if (args == NULL) {
            return NULL;
        }
        PyObject *made = PyTuple_Type.tp_new((PyTypeObject *)cls, args, NULL);
        Py_DECREF(args);
        return made;
    }
    """
    object new_record "fastcall_new_record" (object cls, object fields)



