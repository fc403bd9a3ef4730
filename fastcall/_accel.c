/* fastcall's hit path in C: `FastWrapper` (the object a wrapped function is, where this
 * extension is built: it enters the fast route and runs the structure path).
 * FASTCALL_CHECK_HITS=1 (fastcall/_agreement.py) checks every
 * call it serves against the general path.
 *
 * A call with positional arguments only first goes to the fast route
 * (fastcall/_fast_route.py, one source: compiled by Cython, entered here through its C
 * function `SERVE` with this call's argument array; run as Python, called as a function).
 * It serves `f(first, *arrays)` from first's FastRecord, or declines.
 *
 * Any call it declines (and any with keyword arguments) tries the structure path
 * (`StructureRecord`): `structures` (the function's `state.structures`) has a
 * record for type(first) (and the call's keyword names, in call order:
 * `_fast.structure_key`; that record, then each of its `others`, tried in turn) with
 * arity == len(args), and every argument, taken in the record's `order`,
 * reads as the record says (`_structure_route.read_arguments` is the Python copy): a
 * plain leaf as is; a static one (`StaticRead`) if it is the recorded object,
 * or a scalar equal to it; any other from the identity cache (`by_id`: an entry whose ref() is the
 * argument, whose guard holds and whose spec id is the expected one), or as one
 * of the objects the latest call of a recent entry returned (`latest_leaves`), or
 * else from its structure's extractor (not None), unless it is the object last read
 * there (`last`); an NNX object (`NodeRead`; each of a tuple, list, dict or
 * other pytree of them, `NodesRead`) from its cache entry, if the fast index publishes a slot for it
 * (validated as the fast route validates one) whose entry (`FastSlot.node`) has
 * the expected spec: its leaves' current values; a Variable passed on its own, the
 * call's only NNX object (`VariableRead`), if of the recorded type and metadata: its
 * value; a GraphDef (`GraphdefRead`)
 * if `GRAPHDEFS` knows this very object under the expected spec, unchanged.
 * Calls with NNX objects are served outside any JAX trace, or inside one where the call
 * writes nothing back and the function may run nested (`serves_nested`), and only when the
 * objects are known to share nothing (`NodeEntry.disjoint`). The call then
 * passes those leaves in order; `post` gets the NnxArgs of the NNX objects.
 *
 * Every other case goes to `fallback`, the Python wrapper, which holds all the logic. This
 * module is an optional accelerator: if it fails to build or import, fastcall behaves
 * identically, only slower.
 *
 * The records are NamedTuples; their fields are read through the index
 * constants below, and `configure` (called once, by `_dispatch`, with the
 * shared tables and the record classes) checks the Python field names against
 * them, so a change of layout on one side fails loudly instead of misreading.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* FastSlot(ref, records, guard, node) */
#define SLOT_REF 0
#define SLOT_RECORDS 1
#define SLOT_GUARD 2
#define SLOT_NODE 3
static const char *SLOT_FIELDS[] = {"ref", "records", "guard", "node", NULL};
/* StructureRecord(arity, reads, call, post, last, fast_shape, kwnames, order, hold_first, others) */
#define STR_ARITY 0
#define STR_READS 1
#define STR_CALL 2
#define STR_POST 3
#define STR_LAST 4
#define STR_FAST_SHAPE 5
#define STR_KWNAMES 6
#define STR_ORDER 7
#define STR_HOLD_FIRST 8
#define STR_OTHERS 9
#define STR_N_FIELDS 10
static const char *STRUCTURE_FIELDS[] = {"arity", "reads", "call", "post", "last", "fast_shape", "kwnames", "order",
                                         "hold_first", "others", NULL};
/* ArgRead(spec_id, extract, sequence, by_identity) */
#define READ_SPEC_ID 0
#define READ_EXTRACT 1
#define READ_SEQUENCE 2
#define READ_BY_IDENTITY 3
static const char *READ_FIELDS[] = {"spec_id", "extract", "sequence", "by_identity", NULL};
/* SequenceRead, TreeRead: read by `_tree_reads` (see read_leaves); their classes told apart here */
static const char *SEQUENCE_READ_FIELDS[] = {"kind", "length", "leaf_types", "keys", "items", "n_leaves", NULL};
static const char *TREE_READ_FIELDS[] = {"flatten", "treedef", "leaf_types", NULL};
/* StaticRead(spec_id, value, by_value): matched by `_tree_reads.static_matches` */
#define STATIC_VALUE 1
static const char *STATIC_READ_FIELDS[] = {"spec_id", "value", "by_value", NULL};
/* NodeRead(spec_id), GraphdefRead(spec_id) */
#define NODE_SPEC_ID 0
static const char *NODE_READ_FIELDS[] = {"spec_id", NULL};
/* NodesRead(spec_id, kind, elements, keys) */
#define NODES_KIND 1
#define NODES_ELEMENTS 2
#define NODES_KEYS 3
static const char *NODES_READ_FIELDS[] = {"spec_id", "kind", "elements", "keys", NULL};
/* MixedRead(spec_id, flatten, is_leaf, treedef, layout) */
#define MIXED_FLATTEN 1
#define MIXED_IS_LEAF 2
#define MIXED_TREEDEF 3
#define MIXED_LAYOUT 4
#define MIXED_N_FIELDS 5
static const char *MIXED_READ_FIELDS[] = {"spec_id", "flatten", "is_leaf", "treedef", "layout", NULL};
/* JointRead(spec_id, entry, node_ids, keep) */
#define JOINT_ENTRY 1
#define JOINT_NODE_IDS 2
#define JOINT_KEEP 3
static const char *JOINT_READ_FIELDS[] = {"spec_id", "entry", "node_ids", "keep", NULL};
/* SharedVariableRead(spec_id, owner, position, first) */
#define SHARED_OWNER 1
#define SHARED_POSITION 2
#define SHARED_FIRST 3
static const char *SHARED_VARIABLE_READ_FIELDS[] = {"spec_id", "owner", "position", "first", NULL};
/* VariableRead(spec_id, kind, metadata, metadata_slot) */
#define VARIABLE_KIND 1
#define VARIABLE_METADATA 2
#define VARIABLE_METADATA_SLOT 3
static const char *VARIABLE_READ_FIELDS[] = {"spec_id", "kind", "metadata", "metadata_slot", NULL};
/* KnownGraphdef(graphdef, snapshot, spec_id, spec) */
#define KNOWN_GRAPHDEF 0
#define KNOWN_SNAPSHOT 1
#define KNOWN_SPEC_ID 2
static const char *KNOWN_GRAPHDEF_FIELDS[] = {"graphdef", "snapshot", "spec_id", "spec", NULL};
/* NnxArg(obj, variables, entry, ids, paths, index): made here for the NNX objects read */
#define NNX_ARG_VARIABLES 1
#define NNX_ARG_N_FIELDS 6
static const char *NNX_ARG_FIELDS[] = {"obj", "variables", "entry", "ids", "paths", "index", NULL};
/* RawLeaf(owner, name): a raw leaf of an NNX graph, read as owner.name */
#define RAW_OWNER 0
#define RAW_NAME 1
static const char *RAW_LEAF_FIELDS[] = {"owner", "name", NULL};
/* Registration(position, start, stop, spec, spec_id, guard): an output an entry's memo notes
 * (fastcall/_memo.py, which writes the memo: (regs, ref_0, leaves_0, guard_0, ref_1, ...)) */
#define REG_SPEC_ID 4
#define REG_SIZE 6
#define MEMO_STRIDE 3
static const char *REGISTRATION_FIELDS[] = {"position", "start", "stop", "spec", "spec_id", "guard", NULL};
/* CacheEntry(ref, leaves, spec_id, spec, guard): the identity cache's (fastcall/_flatten.py) */
#define CACHE_REF 0
#define CACHE_LEAVES 1
#define CACHE_SPEC_ID 2
#define CACHE_GUARD 4
static const char *CACHE_FIELDS[] = {"ref", "leaves", "spec_id", "spec", "guard", NULL};

#define N_ENTRY_FIELDS 6 /* the NodeEntry attributes read here (see entry_field) */

/* What every wrapper shares, set once by `configure` (fastcall/_dispatch.py). */
static struct {
    PyObject *index;       /* dict: id(first) -> FastSlot (the fast index) */
    PyObject *by_id;       /* dict: id(obj) -> CacheEntry (the identity cache) */
    PyObject *graphdefs;   /* dict: id(graphdef) -> KnownGraphdef */
    PyObject *value_slot;  /* one-element list: the Variable._raw_value descriptor, or None */
    PyObject *array_type;  /* jaxlib ArrayImpl */
    PyObject *varying_type; /* _outputs.Varying: an output carrying its own structure */
    PyObject *arg_read, *node_read, *joint_read, *shared_variable_read, *nodes_read, *variable_read, *graphdef_read, *static_read,
        *nnx_arg, *raw_leaf, *tree_read, *mixed_read; /* record classes */
    PyObject *empty_ids;   /* frozenset(): NnxArg.ids of an object read from its entry */
    PyObject *s_spec_id, *s_fresh, *s_items, *s_paths, *s_disjoint, *s_node_ids; /* NodeEntry attributes */
    PyObject *s_dict;         /* "__dict__" */
    PyObject *s_objects;      /* "objects" (NodesRead.objects) */
    PyObject *s_level;        /* "level" (PytreeShape.level) */
    /* NodeEntry's slot descriptors for s_spec_id .. s_node_ids, of `entry_type` (see entry_field) */
    PyObject *entry_type, *entry_slots[N_ENTRY_FIELDS];
    /* The fast route's C entry (fastcall/_fast_route.py's SERVE), NULL where that module runs
     * as Python; and what the route returns for a call it declines */
    PyObject *(*serve)(PyObject *route, PyObject *const *args, Py_ssize_t nargs);
    PyObject *declined;
    /* `_trace.may_serve_nnx`'s C entry (`_trace.MAY_SERVE_NNX`), NULL where that module runs
     * as Python; and the function (see may_serve_nnx) */
    int (*may_serve_nnx)(int nested_ok);
    PyObject *may_serve_nnx_py;
    /* `_guard.holds`'s C entry (`_guard.HOLDS`), NULL where that module runs as Python; and
     * the function (see guard_holds) */
    int (*guard_holds)(PyObject *guard);
    PyObject *guard_holds_py;
    /* `_memo.latest_leaves`'s C entry (`_memo.LATEST_LEAVES`), NULL where that module runs
     * as Python; and the function (see latest_leaves) */
    PyObject *(*latest_leaves)(PyObject *obj, PyObject *spec_id);
    PyObject *latest_leaves_py;
    /* `_tree_reads`'s C entries, NULL where that module runs as Python; and its functions
     * (see read_leaves) */
    PyObject *(*sequence_leaves)(PyObject *read, PyObject *a);
    PyObject *(*tree_leaves)(PyObject *read, PyObject *a);
    int (*static_matches)(PyObject *read, PyObject *a);
    PyObject *sequence_leaves_py, *tree_leaves_py, *static_matches_py;
} G;

/* A dict's version tag (PEP 509): changed by every dict operation that changes what the
 * dict holds, and never shared by two states of one dict. Not by every write, though: an
 * object's attribute dict (`vars(obj)`) may share its values with the object (3.13), and an
 * attribute set on the object writes there without a new tag; so the tag is trusted only
 * for a dict with a combined table (`ma_values` NULL), which nothing else shares.
 * Deprecated since 3.12 and gone in 3.14; where it is not there (or the build is
 * free-threaded), guards compare in full. */
#if PY_VERSION_HEX < 0x030E0000 && !defined(Py_GIL_DISABLED)
#define HAVE_DICT_VERSION 1
static inline unsigned long long
dict_version(PyObject *d)
{
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    return (unsigned long long)((PyDictObject *)d)->ma_version_tag;
#pragma GCC diagnostic pop
}
#endif

/* A dict lookup a wrapper remembers (see remembered). */
typedef struct {
    const void *key;             /* the key looked up (compared, never dereferenced) */
    PyObject *value;             /* what was found (borrowed: the dict holds it), or NULL: absent */
    unsigned long long version;  /* the dict's version tag then; 0: nothing remembered (no tag is 0) */
} Lookup;

#define MEMO_ARGS 4

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback;    /* the Python wrapper: handles every other case */
    PyObject *fast;        /* the fast route (_fast_route.FastRoute), tried first */
    PyObject *structures;  /* dict: type(first) -> StructureRecord (this function's) */
    PyObject *state;       /* key of this wrapped function in slot.records */
    PyObject *on_error;    /* on_error(exception, args, kwargs or None): re-raises it, made clearer */
    PyObject *finish_varying; /* finish_varying(output, args, kwargs or None): see fw_varying */
    Py_ssize_t structure_calls; /* calls served by the structure path (paths["c_structure"]) */
    int serves_nested;     /* FunctionState.serves_nested: a read-only call may run nested in a trace */
    PyObject *plain;       /* frozenset: FunctionState.plain_leaves, types passed to jax.jit as they are */
    PyObject *dict;
    PyObject *weakreflist;
    /* The last call's lookups (see remembered): of the fast index per argument position up
     * to MEMO_ARGS (slot_of), and of its structure record for the first argument's type */
    Lookup memo_slot[MEMO_ARGS], memo_structure;
    Lookup memo_graphdef; /* (and of GRAPHDEFS, for a GraphDef argument: read_graphdef) */
    /* The address of the structure record that served this function's last structure-path
     * call among several of one key (fw_structure): compared with the key's records' only,
     * never followed, so it needs no reference (an address reused by a new record of the key
     * only puts that one first) */
    const void *last_served;
#ifdef HAVE_DICT_VERSION
    /* the VariableRead (strong: its address is not reused while remembered) whose expected
     * metadata a Variable's metadata dict was last found to hold, and that dict's version
     * tag then (see metadata_matches) */
    PyObject *memo_read;
    unsigned long long memo_metadata_version;
#endif
} FastWrapper;

/* Code a served call never runs is marked cold: the compiler lays it out apart from the
 * code that serves calls, which is then denser. It matters: a call's cost here is mostly
 * instruction and data cache misses (jax's dispatch, in between, evicts this code), more
 * than the instructions themselves. For the same reason each way the structure path reads
 * an argument is kept out of line (ONE_KIND): a call runs the reads its arguments need, so
 * each read's code stays together instead of spread through the path's. */
#if defined(__GNUC__) || defined(__clang__)
#define COLD __attribute__((cold, noinline))
#define ONE_KIND __attribute__((noinline))
#else
#define COLD
#define ONE_KIND
#endif

COLD static PyObject *
fw_fallback(FastWrapper *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

/* Whether `a` is passed to jax.jit as it is (a jax array, the common case, checked first):
 * 1, 0, or error (-1). (`_structure_route.read_arguments` is the Python copy.) */
static inline int
is_plain(FastWrapper *self, PyObject *a)
{
    PyObject *t = (PyObject *)Py_TYPE(a);
    return t == G.array_type ? 1 : PySet_Contains(self->plain, t);
}

/* `_guard.holds(guard)`: whether every container of a guard (fastcall/_guard.py) still
 * holds what it held: 1, or 0 (also where the check failed: a guard not known to hold
 * sends the call to the general path, which reads the object afresh); through its C entry
 * where that module is compiled. */
static int
guard_holds(PyObject *guard)
{
    int held;
    if (G.guard_holds != NULL) {
        held = G.guard_holds(guard);
    } else {
        PyObject *res = PyObject_CallOneArg(G.guard_holds_py, guard);
        held = res == NULL ? -1 : PyObject_IsTrue(res);
        Py_XDECREF(res);
    }
    if (held < 0) {
        PyErr_Clear();
        return 0;
    }
    return held;
}

/* Whether the weak reference `ref` refers to `obj` (1), not (0), or error (-1).
 * (A strong token, `_flatten._Strong`, for a top-level list or dict `_flatten.hold`
 * holds, holds its object first; anything else that is not a weakref is called.) */
static int
ref_is(PyObject *ref, PyObject *obj)
{
    if (!PyWeakref_Check(ref)) {
        if (PyTuple_Check(ref) && PyTuple_GET_SIZE(ref) == 2) {
            return PyTuple_GET_ITEM(ref, 0) == obj;
        }
        PyObject *target = PyObject_CallNoArgs(ref);
        if (target == NULL) {
            return -1;
        }
        int same = target == obj;
        Py_DECREF(target);
        return same;
    }
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *target;
    if (PyWeakref_GetRef(ref, &target) < 0) {
        return -1;
    }
    int same = target == obj;
    Py_XDECREF(target);
    return same;
#else
    return PyWeakref_GET_OBJECT(ref) == obj;
#endif
}

/* fn(head, args as a tuple, keyword arguments as a dict or None): a call's arguments handed
 * to Python. */
COLD static PyObject *
call_with_arguments(PyObject *fn, PyObject *head, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *res = NULL;
    PyObject *argtuple = PyTuple_New(nargs);
    PyObject *kwargs = kwnames == NULL ? Py_NewRef(Py_None) : PyDict_New();
    for (Py_ssize_t j = 0; kwargs != NULL && kwnames != NULL && j < PyTuple_GET_SIZE(kwnames); j++) {
        if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, j), args[nargs + j]) < 0) {
            Py_CLEAR(kwargs);
        }
    }
    if (argtuple != NULL && kwargs != NULL) {
        for (Py_ssize_t i = 0; i < nargs; i++) {
            Py_INCREF(args[i]);
            PyTuple_SET_ITEM(argtuple, i, args[i]);
        }
        res = PyObject_CallFunctionObjArgs(fn, head, argtuple, kwargs, NULL);
    }
    Py_XDECREF(argtuple);
    Py_XDECREF(kwargs);
    return res;
}

/* After a failed call of the compiled function: hand the exception to on_error, which
 * re-raises it (translated where it can). */
COLD static PyObject *
fw_failed(FastWrapper *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) {
        PyException_SetTraceback(value, tb);
    }
    PyObject *res = value == NULL ? NULL : call_with_arguments(self->on_error, value, args, nargsf, kwnames);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (res != NULL) { /* on_error must raise; be safe if it does not */
        Py_DECREF(res);
        PyErr_SetString(PyExc_RuntimeError, "fastcall: error handler returned");
    }
    return NULL;
}

/* A call whose output carries its own structure (a `Varying`: its trace met another output
 * structure than the one the record was made for): the general path finishes it, and counts
 * it. Steals `out`. */
COLD static PyObject *
fw_varying(FastWrapper *self, Py_ssize_t *counter, PyObject *out, PyObject *const *args, size_t nargsf,
           PyObject *kwnames)
{
    (*counter)--;
    PyObject *res = call_with_arguments(self->finish_varying, out, args, nargsf, kwnames);
    Py_DECREF(out);
    return res;
}

/* `table[id(obj)]` (borrowed), or NULL: not there, or an error (check PyErr_Occurred). The
 * fast index, the identity cache, GRAPHDEFS and the entries' `disjoint` caches are keyed by id. */
static PyObject *
by_id_of(PyObject *table, PyObject *obj)
{
    PyObject *key = PyLong_FromVoidPtr(obj);
    if (key == NULL) {
        return NULL;
    }
    PyObject *found = PyDict_GetItemWithError(table, key);
    Py_DECREF(key);
    return found;
}

#define SMALL_STACK 64

/* Owned references a structure-path call collects (its NNX values, the cache entries it
 * read), in a C array: on the C stack up to SMALL_STACK, then on the heap. (A Python list
 * each call cost more than the reads it collects: its allocation, growth and release run
 * CPython code that jax's dispatch, in between calls, evicts from the CPU's caches.) */
typedef struct {
    PyObject **items;
    Py_ssize_t n, cap;
    PyObject *small[SMALL_STACK];
} Refs;

static void
refs_init(Refs *r)
{
    r->items = r->small;
    r->n = 0;
    r->cap = SMALL_STACK;
}

/* Append `obj`, a new reference, which this takes over (also on failure): 0, or -1 with
 * an exception set. */
static int
refs_push(Refs *r, PyObject *obj)
{
    if (r->n == r->cap) {
        Py_ssize_t cap = 2 * r->cap;
        PyObject **items = PyMem_Malloc(cap * sizeof(PyObject *));
        if (items == NULL) {
            Py_DECREF(obj);
            PyErr_NoMemory();
            return -1;
        }
        memcpy(items, r->items, r->n * sizeof(PyObject *));
        if (r->items != r->small) {
            PyMem_Free(r->items);
        }
        r->items = items;
        r->cap = cap;
    }
    r->items[r->n++] = obj;
    return 0;
}

/* Release every reference held (the last step of a call: releasing may run code). */
static void
refs_release(Refs *r)
{
    for (Py_ssize_t i = 0; i < r->n; i++) {
        Py_DECREF(r->items[i]);
    }
    if (r->items != r->small) {
        PyMem_Free(r->items);
    }
    refs_init(r);
}

/* What one positional argument gives a structure-path call: nothing of its own (a plain
 * leaf, passed as it is: `part` NULL, `n_values` -1); its leaves (`part`, a tuple or list,
 * and `key`, its id); or, for an NNX argument, the number of values it added to the call's
 * `values` (a GraphDef: 0). */
typedef struct {
    PyObject *part;
    PyObject *key;
    Py_ssize_t n_values;
} ArgLeaves;

/* `d[key]` (or with `by_id`, `d[id(key)]`): borrowed, or NULL: not there, or an error
 * (check PyErr_Occurred); through the lookup `m` remembers. A wrapper remembers its last
 * lookups, so that a loop calling it with the same objects makes no id and no dict lookup
 * (both cost more in a call than their few instructions: their code and data are out of
 * the CPU's caches after jax's dispatch). What it remembers holds while the dict's version
 * tag is unchanged: every insertion, replacement and removal gives it a new one, and tags
 * are never reused (not by another dict either). So a value remembered is still there,
 * alive (the dict holds it), and a key remembered absent is still absent. A key is only
 * compared: a new object at a dead one's address has the dead one's fast-index slot only
 * until its death evicts it (a change of the index), and the slot's weak reference is
 * checked anyway. (The dicts looked up are plain dicts, combined tables, whose tag changes
 * with every write; see dict_version.) */
static PyObject *
remembered(Lookup *m, PyObject *d, PyObject *key, int by_id)
{
#ifdef HAVE_DICT_VERSION
    unsigned long long version = dict_version(d);
    if (m->key == (const void *)key && m->version == version) {
        return m->value;
    }
#endif
    PyObject *value = by_id ? by_id_of(d, key) : PyDict_GetItemWithError(d, key);
#ifdef HAVE_DICT_VERSION
    if (value != NULL || !PyErr_Occurred()) {
        m->key = key;
        m->value = value;
        m->version = version;
    }
#endif
    return value;
}

/* `G.index[id(a)]` for the argument at `position` (-1: an object inside an argument, whose
 * lookup is not remembered). */
static PyObject *
slot_of(FastWrapper *self, PyObject *a, Py_ssize_t position)
{
    if (position < 0 || position >= MEMO_ARGS) {
        return by_id_of(G.index, a);
    }
    return remembered(&self->memo_slot[position], G.index, a, 1);
}

/* The leaves of `a` (a new reference to a list) if it is one of the objects the latest
 * call of a recently run entry returned, with spec `spec_id`, and its guard (if any) holds;
 * NULL without an error if not: `_memo.latest_leaves`, through its C entry where that module
 * is compiled. */
static PyObject *
latest_leaves(PyObject *a, PyObject *spec_id)
{
    PyObject *leaves = G.latest_leaves != NULL ? G.latest_leaves(a, spec_id)
                                               : PyObject_CallFunctionObjArgs(G.latest_leaves_py, a, spec_id, NULL);
    if (leaves == Py_None) {
        Py_DECREF(leaves);
        return NULL;
    }
    return leaves;
}

/* The leaves of `a` (a new reference to a tuple or list) if the identity cache holds a
 * current entry for it (key: id(a)) of spec `spec_id`, or it is one of the latest
 * outputs (`latest_leaves`); NULL without an error if not. */
ONE_KIND static PyObject *
cached_leaves(FastWrapper *self, PyObject *a, PyObject *key, PyObject *spec_id)
{
    PyObject *entry = PyDict_GetItemWithError(G.by_id, key); /* borrowed */
    PyObject *leaves = NULL;
    if (entry != NULL && PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) == 5) {
        Py_INCREF(entry); /* (calling a strong token's ref may run code) */
        int same = ref_is(PyTuple_GET_ITEM(entry, CACHE_REF), a);
        if (same == 1) {
            PyObject *guard = PyTuple_GET_ITEM(entry, CACHE_GUARD);
            PyObject *found = PyTuple_GET_ITEM(entry, CACHE_LEAVES);
            if ((guard == Py_None || guard_holds(guard))
                && (PyTuple_CheckExact(found) || PyList_CheckExact(found))) {
                int match = PyObject_RichCompareBool(PyTuple_GET_ITEM(entry, CACHE_SPEC_ID), spec_id, Py_EQ);
                if (match == 1) {
                    Py_INCREF(found);
                    leaves = found;
                }
            }
        }
        Py_DECREF(entry);
    }
    if (leaves == NULL && !PyErr_Occurred()) {
        leaves = latest_leaves(a, spec_id);
    }
    return leaves;
}

/* Whether `last[i]`, a mark `last_mark` made, is of `a` (whose id is `key`): 1, 0, or
 * error (-1). (`_fast.passed_again` is the Python copy.) */
static int
was_last(PyObject *last, Py_ssize_t i, PyObject *a, PyObject *key)
{
    PyObject *mark = PyList_GET_ITEM(last, i);
    if (PyLong_CheckExact(mark)) {
        return PyObject_RichCompareBool(mark, key, Py_EQ);
    }
    return PyWeakref_CheckRef(mark) ? ref_is(mark, a) : 0;
}

/* What `StructureRecord.last` keeps of the argument `a` read at one position (a new
 * reference; `_fast.last_mark` is the Python copy, and says why): a weak reference to
 * it; for a list or dict passed `first` to f(first, *arrays), its id `key`; else None. */
static PyObject *
last_mark(PyObject *a, PyObject *key, int first)
{
    if (PyType_SUPPORTS_WEAKREFS(Py_TYPE(a))) {
        return PyWeakref_NewRef(a, NULL);
    }
    PyObject *mark = first && (PyList_CheckExact(a) || PyDict_CheckExact(a)) ? key : Py_None;
    Py_INCREF(mark);
    return mark;
}

/* The graph node a RawLeaf's owner stands for (a new reference): the referent of a live
 * weak proxy, so that each attribute read or write goes to it directly rather than through
 * the proxy's forwarding (which does the same, one call deeper); else the owner itself (a
 * dead proxy then raises ReferenceError when used, as before). NULL on error. */
static PyObject *
owner_of(PyObject *owner)
{
    if (PyWeakref_CheckProxy(owner)) {
#if PY_VERSION_HEX >= 0x030D0000
        PyObject *target;
        if (PyWeakref_GetRef(owner, &target) < 0) {
            return NULL;
        }
        if (target != NULL) {
            return target;
        }
#else
        PyObject *target = PyWeakref_GET_OBJECT(owner); /* (None once dead: a node is never None) */
        if (target != Py_None) {
            return Py_NewRef(target);
        }
#endif
    }
    return Py_NewRef(owner);
}

/* The attribute `name` of `obj` (a new reference): from `attrs`, its attribute dict, where
 * it is there, else by getattr (NULL with an exception if neither has it): an NNX object's
 * own attribute as NNX's graph flatten reads it (`vars(obj)`: a raw leaf, `_pytree__nodes`,
 * a HashableMapping's `_mapping`), without getattr's walk of its class's attributes.
 * (`_fast.read_raw` reads a raw leaf the same way.) */
static PyObject *
own_attr(PyObject *obj, PyObject *attrs, PyObject *name)
{
    PyObject *value = attrs != NULL && PyDict_CheckExact(attrs) ? PyDict_GetItemWithError(attrs, name) : NULL;
    if (value != NULL) {
        return Py_NewRef(value);
    }
    return PyErr_Occurred() ? NULL : PyObject_GetAttr(obj, name);
}

/* `obj`'s attribute dict (a new reference), or NULL without an exception if it has none. */
static PyObject *
attribute_dict(PyObject *obj)
{
    PyObject *attrs = PyObject_GenericGetDict(obj, NULL);
    if (attrs == NULL) {
        PyErr_Clear(); /* (read by getattr instead: `own_attr`) */
    }
    return attrs;
}

/* What the data descriptor `descr` (of a slot, a Variable's `_raw_value` say) gets from
 * `obj`: a new reference. A member descriptor of an object slot (no audit hook) is read
 * where its own get would read it, when `obj` is an instance of its class and the slot is
 * set: the same object, without two CPython calls whose code jax's dispatch, in between
 * calls, has evicted from the CPU's caches. Otherwise (an empty slot: AttributeError) by
 * the descriptor's get; so too in a free-threaded build, whose get reads atomically. */
static PyObject *
slot_get(PyObject *descr, PyObject *obj)
{
#ifndef Py_GIL_DISABLED
    if (Py_TYPE(descr) == &PyMemberDescr_Type) {
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        PyTypeObject *owner = PyDescr_TYPE(descr);
        if (member->type == T_OBJECT_EX && (member->flags & ~READONLY) == 0
            && (Py_TYPE(obj) == owner || PyType_IsSubtype(Py_TYPE(obj), owner))) {
            PyObject *value = *(PyObject **)((char *)obj + member->offset);
            if (value != NULL) {
                return Py_NewRef(value);
            }
        }
    }
#endif
    descrgetfunc get = Py_TYPE(descr)->tp_descr_get;
    if (get == NULL) {
        PyErr_SetString(PyExc_TypeError, "fastcall: a record's slot descriptor is not a descriptor");
        return NULL;
    }
    return get(descr, obj, (PyObject *)Py_TYPE(obj));
}

/* The current value of one leaf of an NNX record (a new reference): a Variable's through
 * the _raw_value slot descriptor `descr`, a RawLeaf(owner, name)'s as getattr reads it
 * (`own_attr`; `_fast.read_raw` is the Python copy). */
static PyObject *
leaf_value(PyObject *descr, PyObject *item)
{
    if ((PyObject *)Py_TYPE(item) == G.raw_leaf) {
        PyObject *owner = owner_of(PyTuple_GET_ITEM(item, RAW_OWNER));
        if (owner == NULL) {
            return NULL;
        }
        PyObject *attrs = attribute_dict(owner);
        PyObject *value = own_attr(owner, attrs, PyTuple_GET_ITEM(item, RAW_NAME));
        Py_XDECREF(attrs);
        Py_DECREF(owner);
        return value;
    }
    return slot_get(descr, item); /* a Variable's */
}

/* `_trace.may_serve_nnx(nested_ok)`: whether a call with NNX objects may be served here
 * now (1), not (0), or error (-1); through its C entry where that module is compiled. */
static int
may_serve_nnx(int nested_ok)
{
    if (G.may_serve_nnx != NULL) {
        return G.may_serve_nnx(nested_ok);
    }
    PyObject *ok = PyObject_CallOneArg(G.may_serve_nnx_py, nested_ok ? Py_True : Py_False);
    if (ok == NULL) {
        return -1;
    }
    int yes = PyObject_IsTrue(ok);
    Py_DECREF(ok);
    return yes;
}

/* Field `i` (ENTRY_SPEC_ID ..) of a cache entry `node` (an `_nnx._entries.NodeEntry`), a new reference:
 * read through its slot's member descriptor, looked up once per entry type (a data
 * descriptor: what the generic getattr returns, with no instance or type lookup per read);
 * for a type with its own getattr, or no such slot, by getattr. */
#define ENTRY_SPEC_ID 0
#define ENTRY_FRESH 1
#define ENTRY_ITEMS 2
#define ENTRY_PATHS 3
#define ENTRY_DISJOINT 4
#define ENTRY_NODE_IDS 5
static PyObject *
entry_field(PyObject *node, int i)
{
    PyObject *names[N_ENTRY_FIELDS] = {G.s_spec_id, G.s_fresh, G.s_items, G.s_paths, G.s_disjoint, G.s_node_ids};
    PyTypeObject *type = Py_TYPE(node);
    if ((PyObject *)type != G.entry_type) {
        int generic = type->tp_getattro == PyObject_GenericGetAttr;
        for (int j = 0; j < N_ENTRY_FIELDS; j++) {
            PyObject *d = generic ? PyObject_GetAttr((PyObject *)type, names[j]) : NULL;
            if (d != NULL && Py_TYPE(d) != &PyMemberDescr_Type) {
                Py_CLEAR(d);
            }
            PyErr_Clear(); /* (none: read by getattr) */
            Py_XSETREF(G.entry_slots[j], d);
        }
        Py_XSETREF(G.entry_type, Py_NewRef((PyObject *)type));
    }
    PyObject *d = G.entry_slots[i];
    return d != NULL ? slot_get(d, node) : PyObject_GetAttr(node, names[i]);
}

/* Append NnxArg(obj, variables, entry, ids, paths, None) to `nnx_args`, made as namedtuple's
 * own `_make` does (tuple.__new__), without calling its Python __new__. 0, or -1. */
static int
append_nnx_arg(PyObject *nnx_args, PyObject *obj, PyObject *variables, PyObject *entry, PyObject *ids,
               PyObject *paths)
{
    PyObject *fields = PyTuple_Pack(NNX_ARG_N_FIELDS, obj, variables, entry, ids, paths, Py_None);
    PyObject *packed = fields == NULL ? NULL : PyTuple_Pack(1, fields);
    Py_XDECREF(fields);
    PyObject *arg = packed == NULL ? NULL : PyTuple_Type.tp_new((PyTypeObject *)G.nnx_arg, packed, NULL);
    Py_XDECREF(packed);
    int res = arg == NULL ? -1 : PyList_Append(nnx_args, arg);
    Py_XDECREF(arg);
    return res;
}

/* The structure path's reading of one NNX object `a` (`_structure_route.read_arguments` reads
 * the same, through `_nnx._reads.read_cached`, or with `joint`, `_nnx._reads.read_joint`): if the fast
 * index publishes a slot for `a`, validated as the fast route validates one, whose entry
 * (`node`) has spec `spec_id` and has had its values checked for tracers (not `fresh`),
 * append its leaves' current values to `values`, its entry to `entries` and, if `nnx_args`
 * is not NULL, its NnxArg; then 1. With `joint` (a JointRead, whose spec_id is `spec_id`):
 * only if the entry is the one it names, its `node_ids` unchanged, and only the leaves it
 * keeps, with an NnxArg of those and no entry (as the joint flatten's), and the entry not
 * appended to `entries` (the record pins it: nothing to check for sharing). 0 if not (the
 * first value not an array included: the Python copy decides), -1 on error. (On 0 or -1
 * the call is not served here: what was appended is just released.) `position` is the
 * argument's, or -1 for an object inside one (see slot_of). */
static int
read_node(FastWrapper *self, PyObject *a, Py_ssize_t position, PyObject *spec_id, PyObject *joint, Refs *values,
          Refs *entries, PyObject *nnx_args)
{
    PyObject *descr = PyList_GET_ITEM(G.value_slot, 0);
    if (descr == Py_None) {
        return 0;
    }
    PyObject *slot = slot_of(self, a, position); /* borrowed */
    if (slot == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    if (!PyTuple_Check(slot) || PyTuple_GET_SIZE(slot) != 4) {
        return 0;
    }
    Py_INCREF(slot); /* (reading values may run code that withdraws it) */
    PyObject *node = PyTuple_GET_ITEM(slot, SLOT_NODE);
    PyObject *guard = PyTuple_GET_ITEM(slot, SLOT_GUARD);
    PyObject *found = NULL, *items = NULL, *kept = NULL;
    PyObject *keep = joint != NULL ? PyTuple_GET_ITEM(joint, JOINT_KEEP) : Py_None;
    int res = ref_is(PyTuple_GET_ITEM(slot, SLOT_REF), a);
    if (res <= 0) {
        goto done;
    }
    res = 0;
    if (node == Py_None || (guard != Py_None && !guard_holds(guard))) {
        goto done;
    }
    if (joint != NULL) {
        res = ref_is(PyTuple_GET_ITEM(joint, JOINT_ENTRY), node);
        if (res <= 0) {
            goto done;
        }
        found = entry_field(node, ENTRY_NODE_IDS);
        res = found == NULL ? -1 : found == PyTuple_GET_ITEM(joint, JOINT_NODE_IDS);
        if (res <= 0 || (keep != Py_None && !PyTuple_CheckExact(keep))) {
            res = res < 0 ? -1 : 0;
            goto done;
        }
        Py_CLEAR(found);
    }
    found = entry_field(node, ENTRY_SPEC_ID);
    if (found == NULL || (res = PyObject_RichCompareBool(found, spec_id, Py_EQ)) <= 0) {
        res = found == NULL ? -1 : res;
        goto done;
    }
    Py_DECREF(found);
    found = entry_field(node, ENTRY_FRESH);
    if (found == NULL || found != Py_False) {
        res = found == NULL ? -1 : 0;
        goto done;
    }
    items = entry_field(node, ENTRY_ITEMS);
    if (items == NULL || !PyList_CheckExact(items)) {
        res = items == NULL ? -1 : 0;
        goto done;
    }
    Py_ssize_t n = keep == Py_None ? PyList_GET_SIZE(items) : PyTuple_GET_SIZE(keep);
    if (keep != Py_None && nnx_args != NULL && (kept = PyList_New(n)) == NULL) {
        res = -1;
        goto done;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t k = j;
        if (keep != Py_None) {
            k = PyLong_AsSsize_t(PyTuple_GET_ITEM(keep, j));
            if (k < 0 || k >= PyList_GET_SIZE(items)) { /* (not a position of these items) */
                res = PyErr_Occurred() ? -1 : 0;
                goto done;
            }
        }
        PyObject *item = PyList_GET_ITEM(items, k);
        Py_INCREF(item);
        PyObject *value = leaf_value(descr, item);
        if (kept != NULL) {
            PyList_SET_ITEM(kept, j, item); /* (steals the reference) */
        } else {
            Py_DECREF(item);
        }
        if (value == NULL) {
            res = -1;
            goto done;
        }
        /* (tracers: inside an NNX transform; the first value tells, as in the fast path) */
        if (j == 0 && (PyObject *)Py_TYPE(value) != G.array_type) {
            Py_DECREF(value);
            res = 0;
            goto done;
        }
        if (refs_push(values, value) < 0) {
            res = -1;
            goto done;
        }
    }
    if (joint == NULL && refs_push(entries, Py_NewRef(node)) < 0) {
        res = -1;
        goto done;
    }
    if (nnx_args != NULL) {
        Py_DECREF(found);
        found = keep == Py_None ? entry_field(node, ENTRY_PATHS) : Py_NewRef(Py_None);
        if (found == NULL
            || append_nnx_arg(nnx_args, a, kept != NULL ? kept : items, joint != NULL ? Py_None : node, G.empty_ids,
                              found) < 0) {
            res = -1;
            goto done;
        }
    }
    res = 1;
done:
    Py_XDECREF(found);
    Py_XDECREF(items);
    Py_XDECREF(kept);
    Py_DECREF(slot);
    return res;
}

#ifdef HAVE_DICT_VERSION
/* Whether the dicts `d` and `expected` hold the very same values under the same str keys
 * (1, or 0): looked up by exact str keys and compared by identity, so no user code runs. */
static int
same_values(PyObject *d, PyObject *expected)
{
    if (!PyDict_CheckExact(expected) || PyDict_GET_SIZE(d) != PyDict_GET_SIZE(expected)) {
        return 0;
    }
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(d, &pos, &k, &v)) {
        if (!PyUnicode_CheckExact(k)) {
            return 0;
        }
        PyObject *other = PyDict_GetItemWithError(expected, k); /* (an exact str key: no code runs) */
        if (other != v) {
            PyErr_Clear();
            return 0;
        }
    }
    return 1;
}
#endif

/* Whether the Variable `a`'s metadata equals `read`'s copy (1), not (0), or error (-1),
 * read through the slot `read` names. When the dict holds the very objects the copy holds
 * (the usual case: the copy was taken from this Variable, or one sharing its values), its
 * version tag is remembered with the read: a dict with that tag again is in that same
 * state (tags are never reused), so a loop passing one Variable compares once. Only then:
 * a memo of an `==` between distinct objects would miss a change inside one of them, which
 * a comparison would see. The tag is taken before the comparison (which may run code that
 * changes the dict), and the old read is released last (which may run code that enters
 * here). (Trusted only for a combined table: see dict_version.) */
static int
metadata_matches(FastWrapper *self, PyObject *a, PyObject *read)
{
    PyObject *metadata = slot_get(PyTuple_GET_ITEM(read, VARIABLE_METADATA_SLOT), a);
    if (metadata == NULL) {
        return -1;
    }
    PyObject *expected = PyTuple_GET_ITEM(read, VARIABLE_METADATA);
#ifdef HAVE_DICT_VERSION
    int trusted = PyDict_CheckExact(metadata) && ((PyDictObject *)metadata)->ma_values == NULL;
    unsigned long long version = trusted ? dict_version(metadata) : 0;
    if (trusted && self->memo_read == read && self->memo_metadata_version == version) {
        Py_DECREF(metadata);
        return 1;
    }
#endif
    int res = PyObject_RichCompareBool(metadata, expected, Py_EQ);
#ifdef HAVE_DICT_VERSION
    if (res == 1 && trusted && dict_version(metadata) == version && same_values(metadata, expected)) {
        PyObject *old = self->memo_read;
        self->memo_read = Py_NewRef(read);
        self->memo_metadata_version = version;
        Py_XDECREF(old);
    }
#endif
    Py_DECREF(metadata);
    return res;
}

/* The structure path's reading of a Variable passed on its own (`VariableRead`;
 * `_nnx._reads.read_variable_again` is the Python copy): if `a` is of the record's type, with
 * metadata equal to the record's copy and a jax array as value, append that value to
 * `values` and, if `nnx_args` is not NULL, its NnxArg; then 1. 0 if not, -1 on error. */
ONE_KIND static int
read_variable(FastWrapper *self, PyObject *a, PyObject *read, Refs *values, PyObject *nnx_args)
{
    PyObject *descr = PyList_GET_ITEM(G.value_slot, 0);
    if (descr == Py_None || (PyObject *)Py_TYPE(a) != PyTuple_GET_ITEM(read, VARIABLE_KIND)) {
        return 0;
    }
    int res = metadata_matches(self, a, read);
    if (res <= 0) {
        if (res < 0 && PyErr_ExceptionMatches(PyExc_Exception)) {
            PyErr_Clear(); /* (as the Python copy: metadata that cannot be compared declines) */
            res = 0;
        }
        return res;
    }
    PyObject *value = leaf_value(descr, a);
    if (value == NULL) {
        return -1;
    }
    if ((PyObject *)Py_TYPE(value) != G.array_type) {
        Py_DECREF(value); /* (a tracer: inside an NNX transform; the Python copy decides) */
        return 0;
    }
    res = refs_push(values, value) < 0 ? -1 : 1;
    if (res == 1 && nnx_args != NULL) {
        /* NnxArg(a, [a], None, frozenset({id(a)})), as `_nnx._reads._read_variable` makes it */
        PyObject *variables = PyList_New(1);
        PyObject *key = PyLong_FromVoidPtr(a);
        PyObject *ids = NULL;
        if (variables != NULL && key != NULL) {
            Py_INCREF(a);
            PyList_SET_ITEM(variables, 0, a);
            PyObject *one = PyTuple_Pack(1, key);
            ids = one == NULL ? NULL : PyFrozenSet_New(one);
            Py_XDECREF(one);
        }
        res = ids == NULL || append_nnx_arg(nnx_args, a, variables, Py_None, ids, Py_None) < 0 ? -1 : 1;
        Py_XDECREF(variables);
        Py_XDECREF(key);
        Py_XDECREF(ids);
    }
    return res;
}

/* The object the weak reference `ref` refers to (a new reference), or NULL: dead (no
 * exception set), or an error. */
static PyObject *
ref_target(PyObject *ref)
{
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *target;
    return PyWeakref_GetRef(ref, &target) < 0 ? NULL : target;
#else
    PyObject *target = PyWeakref_GET_OBJECT(ref);
    return target == Py_None ? NULL : Py_NewRef(target);
#endif
}

/* The structure path's reading of a Variable passed on its own that another argument
 * holds (`read`, a SharedVariableRead; `_nnx._reads.read_shared_variable` is the Python copy): if
 * `a` is the very Variable at its recorded position among the leaves of the entry that the
 * owner's JointRead pins (this call reads the owner from that entry too, before or after
 * this), then with `first` (it is met before its holder) its value is appended to
 * `values`, else nothing (its holder passes it); and with `nnx_args` its NnxArg, as the
 * joint flatten's (no entry; its one leaf or none); then 1. 0 if not, -1 on error. */
static int
read_shared_variable(PyObject *a, PyObject *read, PyObject *reads, Refs *values, PyObject *nnx_args)
{
    Py_ssize_t owner = PyLong_AsSsize_t(PyTuple_GET_ITEM(read, SHARED_OWNER));
    Py_ssize_t position = PyLong_AsSsize_t(PyTuple_GET_ITEM(read, SHARED_POSITION));
    if (PyErr_Occurred()) {
        return -1;
    }
    int first = PyTuple_GET_ITEM(read, SHARED_FIRST) == Py_True;
    if (owner < 0 || owner >= PyTuple_GET_SIZE(reads)) {
        return 0;
    }
    PyObject *joint = PyTuple_GET_ITEM(reads, owner);
    if ((PyObject *)Py_TYPE(joint) != G.joint_read || PyTuple_GET_SIZE(joint) != 4
        || !PyWeakref_Check(PyTuple_GET_ITEM(joint, JOINT_ENTRY))) {
        return 0;
    }
    PyObject *entry = ref_target(PyTuple_GET_ITEM(joint, JOINT_ENTRY));
    if (entry == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    PyObject *items = entry_field(entry, ENTRY_ITEMS);
    Py_DECREF(entry);
    if (items == NULL) {
        return -1;
    }
    int res = PyList_CheckExact(items) && position >= 0 && position < PyList_GET_SIZE(items)
              && PyList_GET_ITEM(items, position) == a;
    Py_DECREF(items);
    if (res == 1 && first) {
        PyObject *descr = PyList_GET_ITEM(G.value_slot, 0);
        PyObject *value = descr == Py_None ? NULL : leaf_value(descr, a);
        if (value == NULL) {
            return descr == Py_None ? 0 : -1;
        }
        if ((PyObject *)Py_TYPE(value) != G.array_type) {
            Py_DECREF(value); /* (a tracer: inside an NNX transform; the Python copy decides) */
            return 0;
        }
        res = refs_push(values, value) < 0 ? -1 : 1;
    }
    if (res == 1 && nnx_args != NULL) {
        /* NnxArg(a, [a] or [], None, frozenset(), [()] or [], None), as
         * `_nnx._reads.read_shared_variable` makes it */
        PyObject *root = first ? PyTuple_New(0) : NULL; /* (the path of a lone Variable) */
        PyObject *variables = PyList_New(first), *paths = PyList_New(first);
        if (variables != NULL && paths != NULL && first && root != NULL) {
            PyList_SET_ITEM(variables, 0, Py_NewRef(a));
            PyList_SET_ITEM(paths, 0, Py_NewRef(root));
        }
        res = variables == NULL || paths == NULL || (first && root == NULL)
                      || append_nnx_arg(nnx_args, a, variables, Py_None, G.empty_ids, paths) < 0
                  ? -1
                  : 1;
        Py_XDECREF(root);
        Py_XDECREF(variables);
        Py_XDECREF(paths);
    }
    return res;
}

/* The NNX objects of a container argument to read, as `NodesRead.objects` gives them (a
 * new tuple: reading values may run code that changes a list or dict), or NULL: not of the
 * record's kind and size (a dict: keys; another pytree: its PytreeShape), or an error.
 * Another pytree one level deep is flattened here by its `level`; a deeper one by
 * `NodesRead.objects` itself. */
ONE_KIND static PyObject *
nodes_of(PyObject *a, PyObject *read)
{
    PyObject *elements = PyTuple_GET_ITEM(read, NODES_ELEMENTS);
    PyObject *keys = PyTuple_GET_ITEM(read, NODES_KEYS);
    if ((PyObject *)Py_TYPE(a) != PyTuple_GET_ITEM(read, NODES_KIND) || !PyTuple_CheckExact(elements)) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(elements);
    if (keys != Py_None && !PyTuple_CheckExact(keys)) { /* a PytreeShape */
        PyObject *level = PyObject_GetAttr(keys, G.s_level);
        if (level == NULL) {
            return NULL;
        }
        if (PyTuple_CheckExact(level) && PyTuple_GET_SIZE(level) == 2) {
            /* one level: (children, node data) = flatten(a), the node data equal to the
             * record's, n children (each then read by read_node, which only an NNX object's
             * entry passes) */
            PyObject *got = PyObject_CallOneArg(PyTuple_GET_ITEM(level, 0), a);
            PyObject *objs = NULL;
            int same = got != NULL && PyTuple_Check(got) && PyTuple_GET_SIZE(got) == 2;
            if (same) {
                same = PyObject_RichCompareBool(PyTuple_GET_ITEM(got, 1), PyTuple_GET_ITEM(level, 1), Py_EQ);
            }
            if (same > 0) {
                objs = PySequence_Tuple(PyTuple_GET_ITEM(got, 0));
                if (objs != NULL && PyTuple_GET_SIZE(objs) != n) {
                    Py_CLEAR(objs);
                }
            }
            Py_XDECREF(got);
            Py_DECREF(level);
            if (objs == NULL && PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_Exception)) {
                PyErr_Clear(); /* (as the Python copy: a flatten or comparison that raises declines) */
            }
            return objs;
        }
        Py_DECREF(level);
        PyObject *found = PyObject_CallMethodOneArg(read, G.s_objects, a);
        PyObject *objs = found == NULL || found == Py_None ? NULL : PySequence_Tuple(found);
        Py_XDECREF(found);
        if (objs != NULL && PyTuple_GET_SIZE(objs) != n) {
            Py_CLEAR(objs);
        }
        return objs;
    }
    if (PyTuple_CheckExact(a) || PyList_CheckExact(a)) {
        if (keys != Py_None || PySequence_Fast_GET_SIZE(a) != n) {
            return NULL;
        }
        PyObject *objs = PySequence_Tuple(a);
        if (objs != NULL && PyTuple_GET_SIZE(objs) != n) {
            Py_CLEAR(objs);
        }
        return objs;
    }
    if (!PyDict_CheckExact(a) || !PyTuple_CheckExact(keys) || PyTuple_GET_SIZE(keys) != n
        || PyDict_GET_SIZE(a) != n) {
        return NULL;
    }
    PyObject *objs = PyTuple_New(n);
    for (Py_ssize_t j = 0; objs != NULL && j < n; j++) {
        PyObject *x = PyDict_GetItemWithError(a, PyTuple_GET_ITEM(keys, j)); /* borrowed */
        if (x == NULL) {
            /* a key missing, or its lookup raised (a key's __eq__): declined; the general path
             * reads it again, and names any error */
            if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_Exception)) {
                PyErr_Clear();
            }
            Py_CLEAR(objs);
            break;
        }
        Py_INCREF(x);
        PyTuple_SET_ITEM(objs, j, x);
    }
    return objs;
}

/* Whether the GraphDef argument `a` is known (`GRAPHDEFS`) as this very object under spec
 * `spec_id`, unchanged since (compared with its snapshot, if it has one): 1, 0, -1 error. */
ONE_KIND static int
read_graphdef(FastWrapper *self, PyObject *a, PyObject *spec_id)
{
    PyObject *known = remembered(&self->memo_graphdef, G.graphdefs, a, 1); /* borrowed */
    if (known == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    if (!PyTuple_Check(known) || PyTuple_GET_SIZE(known) != 4 || PyTuple_GET_ITEM(known, KNOWN_GRAPHDEF) != a) {
        return 0;
    }
    Py_INCREF(known); /* (comparing runs code) */
    int res = PyObject_RichCompareBool(PyTuple_GET_ITEM(known, KNOWN_SPEC_ID), spec_id, Py_EQ);
    PyObject *snapshot = PyTuple_GET_ITEM(known, KNOWN_SNAPSHOT);
    if (res == 1 && snapshot != Py_None) {
        res = PyObject_RichCompareBool(a, snapshot, Py_EQ);
    }
    Py_DECREF(known);
    return res;
}

/* Whether the NNX objects read, by their cache entries in call order, are known to share
 * nothing: each earlier entry's `disjoint` cache (`_nnx._reads.overlapping`: id(later entry) ->
 * (weakref to it, shares nothing?)) says so for every later one. 1 yes; 0 not known so, or
 * not (the Python copy decides); -1 error. */
ONE_KIND static int
known_disjoint(const Refs *entries)
{
    Py_ssize_t n = entries->n;
    for (Py_ssize_t i = 0; i + 1 < n; i++) {
        PyObject *cache = entry_field(entries->items[i], ENTRY_DISJOINT);
        if (cache == NULL) {
            return -1;
        }
        int res = PyDict_CheckExact(cache);
        for (Py_ssize_t j = i + 1; j < n && res == 1; j++) {
            PyObject *other = entries->items[j];
            PyObject *known = by_id_of(cache, other); /* borrowed */
            if (known == NULL) {
                res = PyErr_Occurred() ? -1 : 0;
            } else if (!PyTuple_Check(known) || PyTuple_GET_SIZE(known) != 2
                       || PyTuple_GET_ITEM(known, 1) != Py_True) {
                res = 0;
            } else {
                res = ref_is(PyTuple_GET_ITEM(known, 0), other);
            }
        }
        Py_DECREF(cache);
        if (res != 1) {
            return res;
        }
    }
    return 1;
}

static int
compare_addresses(const void *x, const void *y)
{
    uintptr_t a = (uintptr_t)*(PyObject *const *)x, b = (uintptr_t)*(PyObject *const *)y;
    return (a > b) - (a < b);
}

/* Whether the Variables a structure-path call read on their own (`loose`: the arguments
 * read by a VariableRead, and those inside an argument read by a MixedRead) share nothing:
 * none read twice, none a Variable of an NNX object read from its cache entry (`entries`:
 * each entry's node_ids, the ids of its nodes and Variables), as `_nnx._reads.overlapping` says.
 * 1 yes; 0 no (the Python copy decides: the general path reads such a call jointly); -1
 * error. */
ONE_KIND static int
variables_apart(const Refs *loose, const Refs *entries)
{
    Py_ssize_t n = loose->n;
    if (n > 1) { /* (sorted by address, a repeat is next to its twin) */
        PyObject *small[SMALL_STACK];
        PyObject **sorted = n <= SMALL_STACK ? small : PyMem_Malloc(n * sizeof(PyObject *));
        if (sorted == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(sorted, loose->items, n * sizeof(PyObject *));
        qsort(sorted, n, sizeof(PyObject *), compare_addresses);
        int apart = 1;
        for (Py_ssize_t i = 1; i < n && apart; i++) {
            apart = sorted[i] != sorted[i - 1];
        }
        if (sorted != small) PyMem_Free(sorted);
        if (!apart) {
            return 0;
        }
    }
    for (Py_ssize_t i = 0; i < n && entries->n > 0; i++) {
        PyObject *key = PyLong_FromVoidPtr(loose->items[i]);
        if (key == NULL) {
            return -1;
        }
        int res = 1;
        for (Py_ssize_t k = 0; k < entries->n && res == 1; k++) {
            PyObject *ids = entry_field(entries->items[k], ENTRY_NODE_IDS);
            if (ids == NULL) {
                res = -1;
            } else if (!PyAnySet_Check(ids)) {
                res = 0;
            } else {
                int found = PySet_Contains(ids, key);
                res = found < 0 ? -1 : !found;
            }
            Py_XDECREF(ids);
        }
        Py_DECREF(key);
        if (res != 1) {
            return res;
        }
    }
    return 1;
}

/* The user's result of a call from the compiled function's output `out` (a new
 * reference, consumed): `out` itself where the record's `post` is None, else
 * `post(out, first, nnx)`, where `nnx` is the leaves of the one NNX object (the fast path)
 * or the call's NnxArgs (the structure path), or None. (Where the call writes nothing
 * back, `post` is `OutInfo.fast_post`; where it only writes new leaf values, the NNX
 * plugin's `LeafWrites`: see `_dispatch._writing_back`.) */
static PyObject *
apply_post(PyObject *post, PyObject *out, PyObject *first, PyObject *nnx)
{
    if (post == Py_None) {
        return out;
    }
    PyObject *stack[3] = {out, first, nnx};
    PyObject *result = PyObject_Vectorcall(post, stack, 3, NULL);
    Py_DECREF(out);
    return result;
}

/* The readers of `_tree_reads` (one source, compiled by Cython: see that module), through
 * their C entries where it is compiled, else called as functions. `read_leaves`: the leaves of
 * `a` (a new reference to a tuple, or to None: not of this structure) as the SequenceRead or
 * TreeRead `read` reads them, NULL on error; `static_matches`: whether `a` is the static
 * argument the StaticRead `read` expects, 1, 0, or -1 on error. */
ONE_KIND static PyObject *
read_leaves(PyObject *read, PyObject *a)
{
    if ((PyObject *)Py_TYPE(read) == G.tree_read) {
        return G.tree_leaves != NULL ? G.tree_leaves(read, a)
                                     : PyObject_CallFunctionObjArgs(G.tree_leaves_py, read, a, NULL);
    }
    return G.sequence_leaves != NULL ? G.sequence_leaves(read, a)
                                     : PyObject_CallFunctionObjArgs(G.sequence_leaves_py, read, a, NULL);
}

ONE_KIND static int
static_matches(PyObject *a, PyObject *read)
{
    if (a == PyTuple_GET_ITEM(read, STATIC_VALUE)) {
        return 1; /* (the common case, without a call) */
    }
    if (G.static_matches != NULL) {
        return G.static_matches(read, a);
    }
    PyObject *res = PyObject_CallFunctionObjArgs(G.static_matches_py, read, a, NULL);
    int same = res == NULL ? -1 : PyObject_IsTrue(res);
    Py_XDECREF(res);
    return same;
}

/* The structure path's reading of a pytree holding NNX objects beside other leaves
 * (`read`, a MixedRead; `_structure_route.read_mixed` is the Python copy): jax's flatten of `a`
 * down to its NNX objects, its treedef equal to the record's, then each leaf as the
 * record's layout says: a plain leaf (None) appended to `values`; a static one (StaticRead)
 * compared; a Variable (VariableRead) read by read_variable, and also appended to `loose`
 * (checked with the call's other Variables: variables_apart); an NNX object (its spec id)
 * read by read_node from its cache entry. 1; 0 if not (a flatten or comparison that raises
 * too: the general path reads it again, and names the argument); -1 on error. */
ONE_KIND static int
read_mixed(FastWrapper *self, PyObject *a, PyObject *read, Refs *values, Refs *entries, Refs *loose,
           PyObject *nnx_args)
{
    PyObject *layout = PyTuple_GET_ITEM(read, MIXED_LAYOUT);
    if (!PyTuple_CheckExact(layout)) {
        return 0;
    }
    PyObject *call_args[2] = {a, PyTuple_GET_ITEM(read, MIXED_IS_LEAF)};
    PyObject *flat = PyObject_Vectorcall(PyTuple_GET_ITEM(read, MIXED_FLATTEN), call_args, 2, NULL);
    int got = flat != NULL && PyTuple_CheckExact(flat) && PyTuple_GET_SIZE(flat) == 2
              && PyList_CheckExact(PyTuple_GET_ITEM(flat, 0));
    if (got == 1) {
        got = PyObject_RichCompareBool(PyTuple_GET_ITEM(flat, 1), PyTuple_GET_ITEM(read, MIXED_TREEDEF), Py_EQ);
    }
    if (got < 0 || flat == NULL) {
        Py_XDECREF(flat);
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            return -1;
        }
        PyErr_Clear();
        return 0;
    }
    /* (the leaves list is this call's own: nothing run below can change it) */
    PyObject *items = got == 1 ? PyTuple_GET_ITEM(flat, 0) : NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(layout);
    if (got == 1 && PyList_GET_SIZE(items) != n) {
        got = 0;
    }
    for (Py_ssize_t j = 0; got == 1 && j < n; j++) {
        PyObject *x = PyList_GET_ITEM(items, j);
        PyObject *code = PyTuple_GET_ITEM(layout, j);
        PyObject *kind = (PyObject *)Py_TYPE(code);
        if (code == Py_None) {
            got = is_plain(self, x);
            if (got == 1) {
                got = refs_push(values, Py_NewRef(x)) < 0 ? -1 : 1;
            }
        } else if (kind == G.static_read && PyTuple_GET_SIZE(code) == 3) {
            got = static_matches(x, code);
        } else if (kind == G.variable_read && PyTuple_GET_SIZE(code) == 4) {
            got = read_variable(self, x, code, values, nnx_args);
            if (got == 1) {
                got = refs_push(loose, Py_NewRef(x)) < 0 ? -1 : 1;
            }
        } else if (PyLong_CheckExact(code)) {
            got = read_node(self, x, -1, code, NULL, values, entries, nnx_args);
        } else {
            got = 0;
        }
    }
    Py_DECREF(flat);
    return got;
}

/* Whether the structure record `record` (held) fits this call's arguments on the cheap
 * checks (its arity and keyword names; its reads, `order` and `last` of that length; each
 * plain argument plain, each other read of a known kind): 1, 0 (not: the fallback serves
 * it), -1 error. `given`: the arguments in the order the reads take them (`order`). */
static int
structure_fits(FastWrapper *self, PyObject *record, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
               PyObject **given)
{
    Py_ssize_t arity = PyLong_AsSsize_t(PyTuple_GET_ITEM(record, STR_ARITY));
    if (arity != nargs) {
        return arity == -1 && PyErr_Occurred() ? -1 : 0;
    }
    PyObject *expected_names = PyTuple_GET_ITEM(record, STR_KWNAMES);
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames), n = nargs + nkw;
    if (!PyTuple_CheckExact(expected_names) || PyTuple_GET_SIZE(expected_names) != nkw) {
        return 0;
    }
    for (Py_ssize_t j = 0; j < nkw; j++) { /* (the same names, in the same order) */
        PyObject *name = PyTuple_GET_ITEM(kwnames, j), *expected = PyTuple_GET_ITEM(expected_names, j);
        int same = name == expected ? 1 : PyUnicode_CheckExact(expected) ? PyUnicode_Compare(name, expected) == 0 : 0;
        if (same != 1) {
            return PyErr_Occurred() ? -1 : 0;
        }
    }
    PyObject *reads = PyTuple_GET_ITEM(record, STR_READS);
    PyObject *last = PyTuple_GET_ITEM(record, STR_LAST);
    PyObject *order = PyTuple_GET_ITEM(record, STR_ORDER);
    if (!PyTuple_CheckExact(reads) || PyTuple_GET_SIZE(reads) != n || !PyList_CheckExact(last)
        || PyList_GET_SIZE(last) != n || (order != Py_None && (!PyTuple_CheckExact(order) || PyTuple_GET_SIZE(order) != n))) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t k = i;
        if (order != Py_None) {
            k = PyLong_AsSsize_t(PyTuple_GET_ITEM(order, i));
            if (k < 0 || k >= n) {
                return PyErr_Occurred() ? -1 : 0;
            }
        }
        given[i] = args[k];
        PyObject *read = PyTuple_GET_ITEM(reads, i);
        if (read == Py_None) {
            int plain = is_plain(self, given[i]);
            if (plain != 1) {
                return plain;
            }
            continue;
        }
        PyObject *kind = (PyObject *)Py_TYPE(read);
        Py_ssize_t size = kind == G.static_read ? 3
                          : kind == G.arg_read || kind == G.nodes_read || kind == G.variable_read
                                    || kind == G.joint_read || kind == G.shared_variable_read
                              ? 4
                          : kind == G.mixed_read ? MIXED_N_FIELDS
                                                 : 1;
        if ((kind != G.arg_read && kind != G.node_read && kind != G.nodes_read && kind != G.variable_read
             && kind != G.graphdef_read && kind != G.static_read && kind != G.joint_read
             && kind != G.shared_variable_read && kind != G.mixed_read)
            || PyTuple_GET_SIZE(read) != size) {
            return 0;
        }
    }
    return 1;
}

/* The structure path (see the top of this file) under one record: the call's result (a
 * new reference); or NULL, with an exception, or without one and `*declined` set where
 * the arguments do not read as `record` says (another record of the key may serve them). */
static PyObject *
structure_call(FastWrapper *self, PyObject *record, PyObject *const *args, size_t nargsf, PyObject *kwnames,
               int *declined_out)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    *declined_out = 0;
    if (!PyTuple_Check(record) || PyTuple_GET_SIZE(record) != STR_N_FIELDS) {
        *declined_out = 1;
        return NULL;
    }
    /* Hold what we use: code run from here on (a metaclass's __hash__ in a type test,
     * another thread) may replace the record. */
    Py_INCREF(record);
    /* the arguments, positional then keyword, in the order the reads take them (borrowed:
     * held by the caller); from here on `nargs` counts them all */
    Py_ssize_t n_positional = nargs;
    nargs += kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    PyObject *small_given[SMALL_STACK];
    PyObject **given = nargs <= SMALL_STACK ? small_given : PyMem_Malloc(nargs * sizeof(PyObject *));
    if (given == NULL) {
        Py_DECREF(record);
        return PyErr_NoMemory();
    }
    int fits = structure_fits(self, record, args, n_positional, kwnames, given), fast_shape = 0, hold_first = 0;
    if (fits == 1) {
        fast_shape = PyObject_IsTrue(PyTuple_GET_ITEM(record, STR_FAST_SHAPE));
        hold_first = fast_shape < 0 ? -1 : PyObject_IsTrue(PyTuple_GET_ITEM(record, STR_HOLD_FIRST));
    }
    if (fits != 1 || fast_shape < 0 || hold_first < 0) {
        Py_DECREF(record);
        if (given != small_given) PyMem_Free(given);
        *declined_out = !(fits < 0 || fast_shape < 0 || hold_first < 0);
        return NULL;
    }
    PyObject *reads = PyTuple_GET_ITEM(record, STR_READS);
    PyObject *last = PyTuple_GET_ITEM(record, STR_LAST);
    PyObject *post = PyTuple_GET_ITEM(record, STR_POST);
    PyObject *out = NULL;
    int declined = 0;
    /* What each argument gives (see ArgLeaves); the NNX objects' values in `values`, in
     * argument order, and their cache entries in `entries` */
    ArgLeaves small_reads[SMALL_STACK];
    ArgLeaves *leaves = nargs <= SMALL_STACK ? small_reads : PyMem_Calloc(nargs, sizeof(ArgLeaves));
    Refs values, entries, loose;
    refs_init(&values);
    refs_init(&entries);
    refs_init(&loose); /* the Variables read on their own (VariableRead, and inside a MixedRead) */
    PyObject *nnx_args = NULL; /* (made at the first NNX object read, for a `post`) */
    int nnx_read = 0;
    Py_ssize_t n_joint = 0; /* NNX objects read jointly (JointRead): then every one must be */
    PyObject *small[SMALL_STACK];
    PyObject **stack = NULL;
    if (leaves == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        leaves[i] = (ArgLeaves){NULL, NULL, -1};
    }
    /* Each non-array argument's leaves, as `_structure_route.read_arguments`. */
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *read = PyTuple_GET_ITEM(reads, i);
        if (read == Py_None) {
            total++;
            continue;
        }
        PyObject *a = given[i];
        PyObject *kind = (PyObject *)Py_TYPE(read);
        if (kind == G.static_read) { /* (no leaves) */
            int same = static_matches(a, read);
            if (same != 1) {
                declined = same == 0;
                goto done;
            }
            leaves[i].n_values = 0;
            continue;
        }
        if (kind != G.arg_read) {
            /* an NNX object, a container of them (NodesRead), one holding them beside other leaves
             * (MixedRead), a Variable, or a GraphDef (no leaves) */
            int got = 0;
            Py_ssize_t before = values.n;
            if (kind == G.graphdef_read) {
                got = read_graphdef(self, a, PyTuple_GET_ITEM(read, NODE_SPEC_ID));
            } else {
                if (!nnx_read) {
                    nnx_read = 1;
                    if (post != Py_None && (nnx_args = PyList_New(0)) == NULL) {
                        goto done;
                    }
                }
                if (kind == G.node_read) {
                    got = read_node(self, a, i, PyTuple_GET_ITEM(read, NODE_SPEC_ID), NULL, &values, &entries,
                                    nnx_args);
                } else if (kind == G.joint_read) {
                    got = read_node(self, a, i, PyTuple_GET_ITEM(read, NODE_SPEC_ID), read, &values, &entries,
                                    nnx_args);
                    n_joint++;
                } else if (kind == G.variable_read) {
                    got = read_variable(self, a, read, &values, nnx_args);
                    if (got == 1) {
                        got = refs_push(&loose, Py_NewRef(a)) < 0 ? -1 : 1;
                    }
                } else if (kind == G.mixed_read) {
                    got = read_mixed(self, a, read, &values, &entries, &loose, nnx_args);
                } else if (kind == G.shared_variable_read) {
                    got = read_shared_variable(a, read, reads, &values, nnx_args);
                    n_joint++;
                } else {
                    PyObject *elements = PyTuple_GET_ITEM(read, NODES_ELEMENTS);
                    PyObject *objs = nodes_of(a, read);
                    got = objs != NULL;
                    for (Py_ssize_t j = 0; got == 1 && j < PyTuple_GET_SIZE(elements); j++) {
                        PyObject *element = PyTuple_GET_ITEM(elements, j); /* a spec id, or a JointRead */
                        int jointly = (PyObject *)Py_TYPE(element) == G.joint_read && PyTuple_GET_SIZE(element) == 4;
                        got = read_node(self, PyTuple_GET_ITEM(objs, j), -1,
                                        jointly ? PyTuple_GET_ITEM(element, NODE_SPEC_ID) : element,
                                        jointly ? element : NULL, &values, &entries, nnx_args);
                        n_joint += jointly;
                    }
                    Py_XDECREF(objs);
                    if (PyErr_Occurred()) {
                        got = -1;
                    }
                }
            }
            if (got != 1) {
                declined = got == 0;
                goto done;
            }
            leaves[i].n_values = values.n - before;
            total += leaves[i].n_values;
            continue;
        }
        leaves[i].key = PyLong_FromVoidPtr(a);
        if (leaves[i].key == NULL) {
            goto done;
        }
        int again = 0;
        if (i == 0 && fast_shape) { /* passed again: the general path gives it a fast record */
            again = was_last(last, 0, a, leaves[0].key);
            if (again != 0) {
                declined = again > 0;
                goto done;
            }
        }
        leaves[i].part = cached_leaves(self, a, leaves[i].key, PyTuple_GET_ITEM(read, READ_SPEC_ID));
        if (leaves[i].part == NULL) {
            if (PyErr_Occurred()) {
                goto done;
            }
            PyObject *extract = PyTuple_GET_ITEM(read, READ_EXTRACT);
            if (extract == Py_None || (again = was_last(last, i, a, leaves[i].key)) != 0) {
                declined = again >= 0; /* (extracted again: the general path caches it) */
                goto done;
            }
            PyObject *sequence = PyTuple_GET_ITEM(read, READ_SEQUENCE);
            leaves[i].part = sequence == Py_None ? PyObject_CallOneArg(extract, a) : read_leaves(sequence, a);
            if (leaves[i].part == NULL) {
                goto done;
            }
            if (!PyTuple_CheckExact(leaves[i].part)) { /* None: not of this structure */
                declined = 1;
                goto done;
            }
        }
        total += PySequence_Fast_GET_SIZE(leaves[i].part);
    }
    if (nnx_read && (entries.n > 0 || loose.n > 0 || n_joint > 0)) {
        /* NNX objects: sharing nothing (a Variable read on its own, in no entry read and
         * not passed twice), or all read jointly from the entries the record pins, no
         * nnx.cached_partial cache pending, and, for a call that may change state or that jax
         * treats otherwise nested, not inside a JAX trace (`_trace.may_serve_nnx`, as the fast
         * route asks; see FunctionState.serves_nested): the Python copy decides otherwise */
        int ok = 1;
        if (n_joint > 0) {
            ok = entries.n == 0 && loose.n == 0;
        } else {
            if (loose.n > 0 && (loose.n > 1 || entries.n > 0)) {
                ok = variables_apart(&loose, &entries);
            }
            if (ok == 1 && entries.n > 1) {
                ok = known_disjoint(&entries);
            }
        }
        if (ok == 1) {
            ok = may_serve_nnx(post == Py_None && self->serves_nested);
        }
        if (ok != 1) {
            declined = ok == 0;
            goto done;
        }
    }
    stack = total <= SMALL_STACK ? small : PyMem_Malloc(total * sizeof(PyObject *));
    if (stack == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t pos = 0, taken = 0; /* borrowed: held by `values`, `leaves` and `args` */
    for (Py_ssize_t i = 0; i < nargs; i++) {
        if (leaves[i].n_values >= 0) {
            for (Py_ssize_t j = 0; j < leaves[i].n_values; j++) {
                stack[pos++] = values.items[taken++];
            }
        } else if (leaves[i].part != NULL) {
            Py_ssize_t n = PySequence_Fast_GET_SIZE(leaves[i].part);
            PyObject **items = PySequence_Fast_ITEMS(leaves[i].part);
            if (pos + n > total) { /* (a list of cached leaves changed by code run since it was counted) */
                declined = 1;
                goto done;
            }
            for (Py_ssize_t j = 0; j < n; j++) {
                stack[pos++] = items[j];
            }
        } else {
            stack[pos++] = given[i];
        }
    }
    if (pos != total) {
        declined = 1;
        goto done;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        if (leaves[i].key != NULL) {
            PyObject *mark = PyTuple_GET_ITEM(PyTuple_GET_ITEM(reads, i), READ_BY_IDENTITY) == Py_True
                                 ? last_mark(given[i], leaves[i].key, i == 0 && hold_first)
                                 : Py_NewRef(Py_None);
            if (mark == NULL || PyList_SetItem(last, i, mark) < 0) { /* (steals the new reference) */
                goto done;
            }
        }
    }
    self->structure_calls++;
    out = PyObject_Vectorcall(PyTuple_GET_ITEM(record, STR_CALL), stack, total, NULL);
    if (out == NULL) {
        out = fw_failed(self, args, nargsf, kwnames);
        goto done;
    }
    if ((PyObject *)Py_TYPE(out) == G.varying_type) {
        out = fw_varying(self, &self->structure_calls, out, args, nargsf, kwnames);
        goto done;
    }
    out = apply_post(post, out, args[0], nnx_args != NULL ? nnx_args : Py_None);
done:
    if (leaves != NULL) {
        for (Py_ssize_t i = 0; i < nargs; i++) {
            Py_XDECREF(leaves[i].part);
            Py_XDECREF(leaves[i].key);
        }
        if (leaves != small_reads) PyMem_Free(leaves);
    }
    if (stack != NULL && stack != small) PyMem_Free(stack);
    if (given != small_given) PyMem_Free(given);
    refs_release(&values);
    refs_release(&entries);
    refs_release(&loose);
    Py_XDECREF(nnx_args);
    Py_DECREF(record);
    if (declined) {
        Py_XDECREF(out);
        *declined_out = 1;
        return NULL;
    }
    return out;
}

/* The structure path: the record for the call's key (`_fast.structure_key`), then each of
 * its `others` (records of other structures the key met: `_fast.records_of`), until one
 * serves the call; else the fallback. */
static PyObject *
fw_structure(FastWrapper *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *first_type = (PyObject *)Py_TYPE(args[0]);
    PyObject *head; /* borrowed; the key as `_fast.structure_key` makes it */
    if (kwnames == NULL) {
        head = remembered(&self->memo_structure, self->structures, first_type, 0);
    } else {
        PyObject *key = PyTuple_Pack(2, first_type, kwnames);
        if (key == NULL) {
            return NULL;
        }
        head = PyDict_GetItemWithError(self->structures, key);
        Py_DECREF(key);
    }
    if (head == NULL) {
        return PyErr_Occurred() ? NULL : fw_fallback(self, args, nargsf, kwnames);
    }
    /* Held: code run while serving (a metaclass's __hash__, another thread) may replace it;
     * the records of `others` are borrowed from it. */
    Py_INCREF(head);
    PyObject *others = PyTuple_Check(head) && PyTuple_GET_SIZE(head) == STR_N_FIELDS ? PyTuple_GET_ITEM(head, STR_OTHERS)
                                                                                     : NULL;
    Py_ssize_t n_others = others != NULL && PyTuple_CheckExact(others) ? PyTuple_GET_SIZE(others) : 0;
    /* The record that served the last call first (a loop over one structure, after calls of
     * others, is served without reading the newer records' first), then the rest in order. */
    PyObject *hot = NULL;
    for (Py_ssize_t i = -1; n_others > 0 && hot == NULL && i < n_others; i++) {
        PyObject *r = i < 0 ? head : PyTuple_GET_ITEM(others, i);
        hot = (const void *)r == self->last_served ? r : NULL;
    }
    int declined = 1;
    PyObject *out = NULL, *served = NULL;
    for (Py_ssize_t i = -2; out == NULL && declined && i < n_others; i++) {
        PyObject *r = i == -2 ? hot : i == -1 ? head : PyTuple_GET_ITEM(others, i);
        if (r == NULL || (i >= -1 && r == hot)) {
            continue;
        }
        served = r;
        out = structure_call(self, r, args, nargsf, kwnames, &declined);
    }
#ifndef Py_GIL_DISABLED
    if (out != NULL && n_others > 0) {
        self->last_served = served;
    }
#endif
    Py_DECREF(head);
    if (out == NULL && declined) {
        return fw_fallback(self, args, nargsf, kwnames);
    }
    return out;
}

static PyObject *
fw_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    FastWrapper *self = (FastWrapper *)op;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs == 0) {
        return fw_fallback(self, args, nargsf, kwnames);
    }
    if (kwnames != NULL) { /* (the fast route takes positional arguments only) */
        return fw_structure(self, args, nargsf, kwnames);
    }
    /* The fast route (fastcall/_fast_route.py): compiled, through its C entry; run as
     * Python, called as a Python function */
    PyObject *out = G.serve != NULL ? G.serve(self->fast, args, nargs) : PyObject_Vectorcall(self->fast, args, nargs, NULL);
    if (out != G.declined) {
        return out; /* (or NULL: an error) */
    }
    Py_DECREF(out);
    return fw_structure(self, args, nargsf, kwnames);
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
    Py_VISIT(self->structures);
    Py_VISIT(self->state);
    Py_VISIT(self->on_error);
    Py_VISIT(self->finish_varying);
    Py_VISIT(self->plain);
    Py_VISIT(self->dict);
#ifdef HAVE_DICT_VERSION
    Py_VISIT(self->memo_read);
#endif
    return 0;
}

static int
fw_clear(PyObject *op)
{
    FastWrapper *self = (FastWrapper *)op;
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->fast);
    Py_CLEAR(self->structures);
    Py_CLEAR(self->state);
    Py_CLEAR(self->on_error);
    Py_CLEAR(self->finish_varying);
    Py_CLEAR(self->plain);
    Py_CLEAR(self->dict);
#ifdef HAVE_DICT_VERSION
    Py_CLEAR(self->memo_read);
#endif
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

/* The record class `records[name]`, a new reference, if its fields (`_fields`) are
 * `expected`; NULL with an error if not. */
static PyObject *
record_class(PyObject *records, const char *name, const char **expected)
{
    PyObject *cls = PyDict_GetItemString(records, name); /* borrowed */
    if (cls == NULL || !PyType_Check(cls)) {
        PyErr_Format(PyExc_TypeError, "fastcall._accel: no record class %s given", name);
        return NULL;
    }
    PyObject *fields = PyObject_GetAttrString(cls, "_fields");
    if (fields == NULL) {
        return NULL;
    }
    Py_ssize_t n = 0;
    while (expected[n] != NULL) n++;
    if (!PyTuple_Check(fields) || PyTuple_GET_SIZE(fields) != n) {
        PyErr_Format(PyExc_TypeError, "fastcall._accel: %s has another layout than this C build reads", name);
        Py_DECREF(fields);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *field = PyTuple_GET_ITEM(fields, i);
        if (!PyUnicode_Check(field) || PyUnicode_CompareWithASCIIString(field, expected[i]) != 0) {
            PyErr_Format(PyExc_TypeError, "fastcall._accel: %s field %zd is %R, C reads it as '%s'", name, i,
                         field, expected[i]);
            Py_DECREF(fields);
            return NULL;
        }
    }
    Py_DECREF(fields);
    Py_INCREF(cls);
    return cls;
}

#define SET_SHARED(field, value) do { PyObject *old_ = G.field; G.field = (value); Py_XDECREF(old_); } while (0)

/* configure(index, by_id, graphdefs, value_slot, array_type, varying_type, records, serve, declined,
 *           may_serve_nnx, may_serve_nnx_entry, guard_holds, guard_holds_entry, latest_leaves,
 *           latest_leaves_entry, tree_reads):
 * the tables and types every wrapper reads (see the struct G); `records` maps each record
 * class's name to the class, whose fields are checked against the layout read here.
 * Nothing is changed if a check fails. */
static PyObject *
py_configure(PyObject *module, PyObject *args)
{
    PyObject *index, *by_id, *graphdefs, *value_slot, *array_type, *varying_type, *records, *serve, *declined,
        *may_serve, *may_serve_entry, *holds, *holds_entry, *latest, *latest_entry, *tree_reads;
    if (!PyArg_UnpackTuple(args, "configure", 16, 16, &index, &by_id, &graphdefs, &value_slot, &array_type,
                           &varying_type, &records, &serve, &declined, &may_serve, &may_serve_entry, &holds,
                           &holds_entry, &latest, &latest_entry, &tree_reads)) {
        return NULL;
    }
    void *serve_entry = NULL, *may_serve_c = NULL, *holds_c = NULL, *latest_c = NULL;
    if (latest_entry != Py_None
        && (latest_c = PyCapsule_GetPointer(latest_entry, "fastcall._memo.LATEST_LEAVES")) == NULL) {
        return NULL;
    }
    if (holds_entry != Py_None && (holds_c = PyCapsule_GetPointer(holds_entry, "fastcall._guard.HOLDS")) == NULL) {
        return NULL;
    }
    if (serve != Py_None && (serve_entry = PyCapsule_GetPointer(serve, "fastcall._fast_route.SERVE")) == NULL) {
        return NULL;
    }
    if (may_serve_entry != Py_None
        && (may_serve_c = PyCapsule_GetPointer(may_serve_entry, "fastcall._trace.MAY_SERVE_NNX")) == NULL) {
        return NULL;
    }
    if (!PyCallable_Check(may_serve) || !PyCallable_Check(holds) || !PyCallable_Check(latest)) {
        PyErr_SetString(PyExc_TypeError, "configure: may_serve_nnx, guard_holds and latest_leaves must be callable");
        return NULL;
    }
    if (!PyDict_CheckExact(index) || !PyDict_CheckExact(by_id) || !PyDict_CheckExact(graphdefs)
        || !PyDict_Check(records)) {
        PyErr_SetString(PyExc_TypeError, "configure: index, by_id, graphdefs and records must be dicts");
        return NULL;
    }
    if (!PyList_CheckExact(value_slot) || PyList_GET_SIZE(value_slot) != 1) {
        PyErr_SetString(PyExc_TypeError, "configure: value_slot must be a one-element list");
        return NULL;
    }
    enum { N_RECORDS = 18 };
    PyObject *cls[N_RECORDS];
    const char *names[N_RECORDS] = {"FastSlot", "StructureRecord", "CacheEntry", "ArgRead",
                                    "NodeRead", "NodesRead", "GraphdefRead", "KnownGraphdef", "NnxArg",
                                    "RawLeaf", "VariableRead", "Registration", "SequenceRead", "StaticRead", "JointRead", "SharedVariableRead", "TreeRead",
                                    "MixedRead"};
    const char **layouts[N_RECORDS] = {SLOT_FIELDS, STRUCTURE_FIELDS, CACHE_FIELDS,
                                       READ_FIELDS, NODE_READ_FIELDS, NODES_READ_FIELDS, NODE_READ_FIELDS,
                                       KNOWN_GRAPHDEF_FIELDS, NNX_ARG_FIELDS, RAW_LEAF_FIELDS,
                                       VARIABLE_READ_FIELDS, REGISTRATION_FIELDS, SEQUENCE_READ_FIELDS, STATIC_READ_FIELDS, JOINT_READ_FIELDS,
                                       SHARED_VARIABLE_READ_FIELDS, TREE_READ_FIELDS, MIXED_READ_FIELDS};
    for (int i = 0; i < N_RECORDS; i++) {
        cls[i] = record_class(records, names[i], layouts[i]);
        if (cls[i] == NULL) {
            for (int j = 0; j < i; j++) Py_DECREF(cls[j]);
            return NULL;
        }
    }
    /* (made once; each checked, so that a failure leaves none half made) */
    PyObject **made[] = {&G.s_spec_id, &G.s_fresh, &G.s_items, &G.s_paths, &G.s_disjoint, &G.s_node_ids,
                         &G.s_dict, &G.s_objects, &G.s_level};
    const char *strings[] = {"spec_id", "fresh", "items", "paths", "disjoint", "node_ids",
                             "__dict__", "objects", "level"};
    for (int i = 0; i < (int)(sizeof(strings) / sizeof(strings[0])); i++) { /* (made[] and strings[] pair up) */
        if (*made[i] == NULL && (*made[i] = PyUnicode_InternFromString(strings[i])) == NULL) {
            for (int j = 0; j < N_RECORDS; j++) Py_DECREF(cls[j]);
            return NULL;
        }
    }
    if (G.empty_ids == NULL && (G.empty_ids = PyFrozenSet_New(NULL)) == NULL) {
        for (int j = 0; j < N_RECORDS; j++) Py_DECREF(cls[j]);
        return NULL;
    }
    /* `_tree_reads`'s functions and their C entries (capsules, or None run as Python) */
    static const char *reader_names[3] = {"sequence_leaves", "tree_leaves", "static_matches"};
    static const char *entry_names[3] = {"SEQUENCE_LEAVES", "TREE_LEAVES", "STATIC_MATCHES"};
    static const char *capsule_names[3] = {"fastcall._tree_reads.SEQUENCE_LEAVES", "fastcall._tree_reads.TREE_LEAVES",
                                           "fastcall._tree_reads.STATIC_MATCHES"};
    PyObject *readers[3] = {NULL, NULL, NULL};
    void *reader_c[3] = {NULL, NULL, NULL};
    for (int i = 0; i < 3; i++) {
        PyObject *entry = PyObject_GetAttrString(tree_reads, entry_names[i]);
        readers[i] = entry == NULL ? NULL : PyObject_GetAttrString(tree_reads, reader_names[i]);
        if (readers[i] != NULL && !PyCallable_Check(readers[i])) {
            PyErr_Format(PyExc_TypeError, "configure: tree_reads.%s must be callable", reader_names[i]);
            Py_CLEAR(readers[i]);
        }
        if (readers[i] != NULL && entry != Py_None
            && (reader_c[i] = PyCapsule_GetPointer(entry, capsule_names[i])) == NULL) {
            Py_CLEAR(readers[i]);
        }
        Py_XDECREF(entry);
        if (readers[i] == NULL) {
            for (int j = 0; j < i; j++) Py_DECREF(readers[j]);
            for (int j = 0; j < N_RECORDS; j++) Py_DECREF(cls[j]);
            return NULL;
        }
    }
    for (int j = 0; j < 3; j++) Py_DECREF(cls[j]); /* (checked only: read by position) */
    SET_SHARED(arg_read, cls[3]);
    SET_SHARED(node_read, cls[4]);
    SET_SHARED(nodes_read, cls[5]);
    SET_SHARED(graphdef_read, cls[6]);
    Py_DECREF(cls[7]);
    SET_SHARED(nnx_arg, cls[8]);
    SET_SHARED(raw_leaf, cls[9]);
    SET_SHARED(variable_read, cls[10]);
    Py_DECREF(cls[11]); /* (checked only: read by position) */
    Py_DECREF(cls[12]); /* (checked only: read by position) */
    SET_SHARED(static_read, cls[13]);
    SET_SHARED(joint_read, cls[14]);
    SET_SHARED(shared_variable_read, cls[15]);
    SET_SHARED(tree_read, cls[16]);
    SET_SHARED(mixed_read, cls[17]);
    Py_INCREF(index); SET_SHARED(index, index);
    Py_INCREF(by_id); SET_SHARED(by_id, by_id);
    Py_INCREF(graphdefs); SET_SHARED(graphdefs, graphdefs);
    Py_INCREF(value_slot); SET_SHARED(value_slot, value_slot);
    Py_INCREF(array_type); SET_SHARED(array_type, array_type);
    Py_INCREF(varying_type); SET_SHARED(varying_type, varying_type);
    Py_INCREF(may_serve); SET_SHARED(may_serve_nnx_py, may_serve);
    G.may_serve_nnx = (int (*)(int))may_serve_c;
    Py_INCREF(holds); SET_SHARED(guard_holds_py, holds);
    G.guard_holds = (int (*)(PyObject *))holds_c;
    Py_INCREF(latest); SET_SHARED(latest_leaves_py, latest);
    G.latest_leaves = (PyObject *(*)(PyObject *, PyObject *))latest_c;
    SET_SHARED(sequence_leaves_py, readers[0]);
    SET_SHARED(tree_leaves_py, readers[1]);
    SET_SHARED(static_matches_py, readers[2]);
    G.sequence_leaves = (PyObject *(*)(PyObject *, PyObject *))reader_c[0];
    G.tree_leaves = (PyObject *(*)(PyObject *, PyObject *))reader_c[1];
    G.static_matches = (int (*)(PyObject *, PyObject *))reader_c[2];
    Py_INCREF(declined); SET_SHARED(declined, declined);
    G.serve = (PyObject *(*)(PyObject *, PyObject *const *, Py_ssize_t))serve_entry;
    Py_RETURN_NONE;
}

/* FastWrapper(fallback, fast, state, structures, on_error, finish_varying, serves_nested, plain), once
 * `configure` has run. */
static PyObject *
fw_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *fallback, *fast, *state, *structures, *on_error, *finish_varying, *serves_nested, *plain;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "FastWrapper takes positional arguments only");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "FastWrapper", 8, 8, &fallback, &fast, &state, &structures, &on_error,
                           &finish_varying, &serves_nested, &plain)) {
        return NULL;
    }
    int nested = PyObject_IsTrue(serves_nested);
    if (nested < 0) {
        return NULL;
    }
    if (G.index == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "FastWrapper: fastcall._accel.configure has not been called");
        return NULL;
    }
    if (!PyDict_CheckExact(structures)) {
        PyErr_SetString(PyExc_TypeError, "FastWrapper: structures must be a dict");
        return NULL;
    }
    if (!PyFrozenSet_CheckExact(plain)) {
        PyErr_SetString(PyExc_TypeError, "FastWrapper: plain must be a frozenset");
        return NULL;
    }
    FastWrapper *self = (FastWrapper *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = fw_vectorcall;
    Py_INCREF(fallback); self->fallback = fallback;
    Py_INCREF(fast); self->fast = fast;
    Py_INCREF(structures); self->structures = structures;
    Py_INCREF(state); self->state = state;
    Py_INCREF(on_error); self->on_error = on_error;
    Py_INCREF(finish_varying); self->finish_varying = finish_varying;
    Py_INCREF(plain); self->plain = plain;
    self->structure_calls = 0;
    self->serves_nested = nested;
    self->dict = NULL;
    self->weakreflist = NULL;
    return (PyObject *)self;
}

static PyMemberDef fw_members[] = {
    {"_fastcall_c_structure_calls", T_PYSSIZET, offsetof(FastWrapper, structure_calls), READONLY,
     "calls served by the structure path in C"},
    {"fast", T_OBJECT, offsetof(FastWrapper, fast), READONLY, "the fast route, tried first"},
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

static PyMethodDef accel_methods[] = {
    {"configure", py_configure, METH_VARARGS, "Set the tables and record classes every FastWrapper reads."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef accel_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fastcall._accel",
    .m_doc = "Optional C fast path for fastcall.jit.",
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
