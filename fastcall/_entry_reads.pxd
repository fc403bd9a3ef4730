# The functions of _entry_reads.py the compiled structure route calls directly (a C call);
# read by Cython only, at build time. Each returns 1 or 0, or -1 with an error set (read_nodes:
# how many objects it read jointly, or -1 where the record does not serve the argument).
cpdef object item_value(object descr, object item)
cpdef object raw_leaf_value(object leaf)
cpdef bint ref_is(object ref, object obj) except? -1
cpdef bint read_node(object a, object spec_id, object joint, list values, list entries, list nnx_args) except? -1
cpdef Py_ssize_t read_nodes(object a, object read, list values, list entries, list nnx_args) except? -1
cpdef bint read_variable(object a, object read, list values, list nnx_args) except? -1
cpdef bint read_shared_variable(object a, object read, tuple reads, list values, list nnx_args) except? -1
cpdef bint apart(list entries, list loose) except? -1
