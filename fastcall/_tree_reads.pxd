# The readers of _tree_reads.py the compiled structure route calls directly (a C call); read
# by Cython only, at build time. The bint ones: 1 or 0, or -1 with an error set.
cpdef object sequence_leaves(object read, object a)
cpdef bint shaped_as(object read, object a) except? -1
cpdef bint sequence_into(object read, object a, list out) except? -1
cpdef object tree_leaves(object read, object a)
cpdef bint static_matches(object read, object a) except? -1
cpdef bint expand_into(list leaves, tuple expand, list out) except? -1
