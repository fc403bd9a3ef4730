# The function of _trace.py the compiled hit routes call directly (a C call); read by Cython
# only, at build time: 1 or 0, or -1 with an error set.
cpdef bint may_serve_nnx(bint nested_ok) except? -1
