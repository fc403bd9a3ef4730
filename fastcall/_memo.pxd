# The function of _memo.py the compiled structure route calls directly (a C call); read by
# Cython only, at build time.
cpdef object latest_leaves(object obj, object spec_id)
