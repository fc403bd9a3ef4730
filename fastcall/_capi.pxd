# What fastcall's compiled modules (setup.py's COMPILED_SOURCES) use of CPython's C API that
# Cython's own declarations lack. Read by Cython only, at build time.
from cpython.object cimport PyObject

cdef extern from "Python.h":
    object PyObject_Vectorcall(object callable, PyObject **args, size_t nargsf, PyObject *kwnames)

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
