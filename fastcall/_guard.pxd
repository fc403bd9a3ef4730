# The functions of _guard.py the other compiled modules call directly (a C call); read by
# Cython only, at build time. `holds`: 1 or 0, or -1 with an error set.
cpdef object make_checked(object containers)
cpdef bint holds(object guard) except? -1
