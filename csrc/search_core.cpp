// The μGraph search's hot loop in C++: one step of the skeleton generator's DFS
// (torch_mirage/superopt/search/generate.py, enumerate_skeletons: py_children).
//
// children(env, last_rank, share) enumerates the canonical moves of the current state (Mirage §4.1: every
// body op has the rank (operand indices newest first, op kind, operand indices, attrs); only moves ranked
// after the last op are kept,
// in rank order), looks up each move's block op and abstract expression in the generator's memo dicts
// and calls back into Python only on a miss. It returns exactly what py_children returns:
// ([(index among all moves, kind, inputs, attrs, block op, expression) for the moves whose op fits],
// number of moves). Profiling (benchmarks/results/search_profile_cpu.md) measured this step as most of
// the search's own time outside Z3.
//
// env = (KIND_ORDER, enabled per kind, eps_values, scale_values, shapes, dtypes, flags, exprs, op_memo, expr_memo,
//        make_miss, expr_miss); shapes .. exprs are the generator's state lists, read in place.
// last_rank = (inputs newest first, kind index, inputs, ((attr name, value), ...)) with None values as -1.
// share = None, or (k, n, base): move idx is kept only when (base + idx + 1) % n == k.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

namespace {

// Indices into KIND_ORDER (generate.py); checked against the names passed in env at every call.
enum Kind {
  SILU, EXP, SQRT, RMS_NORM, REDUCE_MEAN, ADD, MUL, DIV, SUB, MATMUL, MATMUL_T, CONCAT, CONCAT_MATMUL, ACC_SUM,
  ACC_RMS, SCALAR_MUL, ACC_ONLINE_SOFTMAX, N_KINDS
};
const char* const KIND_NAMES[N_KINDS] = {"silu", "exp", "sqrt", "rms_norm", "reduce_mean", "add", "mul", "div",
                                         "sub", "matmul", "matmul_t", "concat", "concat_matmul", "acc_sum",
                                         "acc_rms", "scalar_mul", "acc_online_softmax"};
constexpr long ABI = 3;     // torch_mirage/superopt/search/native.py: ABI

PyObject* s_dim = nullptr;    // interned "dim"
PyObject* s_eps = nullptr;    // interned "eps"
PyObject* s_value = nullptr;  // interned "value"

// An owned reference, released at scope exit.
struct Ref {
  PyObject* p;
  explicit Ref(PyObject* o = nullptr) : p(o) {}
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  PyObject* release() { PyObject* o = p; p = nullptr; return o; }
};

// Attr kinds of a move: which (name, value) pairs its attrs tuple holds.
enum AttrForm { NO_ATTRS, EPS, DIM_NONE, DIM, DIM_EPS, VALUE };

struct Move {
  int kind;
  int n_in;
  int ins[4];
  AttrForm form;
  int dim;       // DIM, DIM_EPS, CONCAT's dim
  int eps;       // index into eps_values (EPS, DIM_EPS) or scale_values (VALUE)
  int n_rank;    // number of attr values in the rank
  double rank_attrs[2];
};

struct Rank {
  int n_in;
  long desc[4];  // the inputs, newest first
  long ins[4];
  long kind;
  int n_attr;
  double attrs[2];
};

// Python's tuple order on (inputs newest first, kind index, inputs, attr values): a proper prefix is smaller.
template <class A, class B>
int cmp_seq(const A* a, int na, const B* b, int nb) {
  for (int k = 0; k < na && k < nb; ++k) {
    if (a[k] < b[k]) return -1;
    if (a[k] > b[k]) return 1;
  }
  return na < nb ? -1 : (na > nb ? 1 : 0);
}

void newest_first(const long* ins, int n, long* out) {
  std::copy(ins, ins + n, out);
  std::sort(out, out + n, [](long x, long y) { return x > y; });
}

int cmp(const Move& a, const Rank& r) {
  long ins[4], desc[4];
  for (int k = 0; k < a.n_in; ++k) ins[k] = a.ins[k];
  newest_first(ins, a.n_in, desc);
  if (int c = cmp_seq(desc, a.n_in, r.desc, r.n_in)) return c;
  if (a.kind != r.kind) return a.kind < r.kind ? -1 : 1;
  if (int c = cmp_seq(ins, a.n_in, r.ins, r.n_in)) return c;
  return cmp_seq(a.rank_attrs, a.n_rank, r.attrs, r.n_attr);
}

Rank rank_of(const Move& m) {
  Rank r{m.n_in, {0, 0, 0, 0}, {0, 0, 0, 0}, m.kind, m.n_rank, {m.rank_attrs[0], m.rank_attrs[1]}};
  for (int k = 0; k < m.n_in; ++k) r.ins[k] = m.ins[k];
  newest_first(r.ins, r.n_in, r.desc);
  return r;
}

int cmp(const Move& a, const Move& b) { return cmp(a, rank_of(b)); }

bool parse_rank(PyObject* obj, Rank* r) {
  if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 4) {
    PyErr_SetString(PyExc_TypeError, "search core: last_rank must be (inputs newest first, kind index, inputs, "
                                     "attrs)");
    return false;
  }
  PyObject* ins = PyTuple_GET_ITEM(obj, 2);
  PyObject* attrs = PyTuple_GET_ITEM(obj, 3);
  if (!PyTuple_Check(ins) || PyTuple_GET_SIZE(ins) > 4 || !PyTuple_Check(attrs) || PyTuple_GET_SIZE(attrs) > 2) {
    PyErr_SetString(PyExc_TypeError, "search core: last_rank has more than 4 inputs or 2 attrs");
    return false;
  }
  r->n_in = static_cast<int>(PyTuple_GET_SIZE(ins));
  for (int k = 0; k < r->n_in; ++k) r->ins[k] = PyLong_AsLong(PyTuple_GET_ITEM(ins, k));
  newest_first(r->ins, r->n_in, r->desc);
  r->kind = PyLong_AsLong(PyTuple_GET_ITEM(obj, 1));
  r->n_attr = static_cast<int>(PyTuple_GET_SIZE(attrs));
  for (int k = 0; k < r->n_attr; ++k) {
    PyObject* pair = PyTuple_GET_ITEM(attrs, k);
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
      PyErr_SetString(PyExc_TypeError, "search core: a last_rank attr is not a (name, value) pair");
      return false;
    }
    r->attrs[k] = PyFloat_AsDouble(PyTuple_GET_ITEM(pair, 1));
  }
  return !PyErr_Occurred();
}

Move unary(int kind, int i) { return Move{kind, 1, {i, 0, 0, 0}, NO_ATTRS, 0, -1, 0, {0, 0}}; }
Move binary(int kind, int i, int j) { return Move{kind, 2, {i, j, 0, 0}, NO_ATTRS, 0, -1, 0, {0, 0}}; }

// The moves of generate.py's moves(), in the same generation order (stable-sorted afterwards).
void enumerate_moves(const std::vector<std::vector<long>>& sh, const std::vector<long>& flags, const bool* on,
                     const std::vector<double>& eps, const std::vector<double>& scales, std::vector<Move>& out) {
  const int n = static_cast<int>(sh.size());
  const int n_eps = static_cast<int>(eps.size());
  const int n_scales = static_cast<int>(scales.size());
  for (int i = 0; i < n; ++i) {
    const int nd = static_cast<int>(sh[i].size());
    for (int k : {SILU, EXP, SQRT})
      if (on[k]) out.push_back(unary(k, i));
    if (on[RMS_NORM] && nd >= 1)
      for (int e = 0; e < n_eps; ++e) {
        Move m = unary(RMS_NORM, i);
        m.form = EPS; m.eps = e; m.n_rank = 1; m.rank_attrs[0] = eps[e];
        out.push_back(m);
      }
    if (on[REDUCE_MEAN] && nd >= 1 && sh[i][nd - 1] > 1) {   // a row's mean in the block
      Move m = unary(REDUCE_MEAN, i);
      m.form = DIM; m.dim = nd - 1; m.n_rank = 1; m.rank_attrs[0] = nd - 1;
      out.push_back(m);
    }
    if (on[SCALAR_MUL])
      for (int c = 0; c < n_scales; ++c) {
        Move m = unary(SCALAR_MUL, i);
        m.form = VALUE; m.eps = c; m.n_rank = 1; m.rank_attrs[0] = scales[c];
        out.push_back(m);
      }
    if (flags[i] == 0) {
      if (on[ACC_SUM]) {
        Move m = unary(ACC_SUM, i);
        m.form = DIM_NONE; m.n_rank = 1; m.rank_attrs[0] = -1;
        out.push_back(m);
        m.form = DIM; m.dim = nd - 1; m.rank_attrs[0] = nd - 1;
        out.push_back(m);
      }
      if (on[ACC_RMS])
        for (int e = 0; e < n_eps; ++e) {
          Move m = unary(ACC_RMS, i);
          m.form = DIM_EPS; m.dim = nd - 1; m.eps = e; m.n_rank = 2;
          m.rank_attrs[0] = nd - 1; m.rank_attrs[1] = eps[e];
          out.push_back(m);
        }
    }
    for (int j = 0; j < n; ++j) {
      if (flags[i] != flags[j]) continue;
      if (i <= j)
        for (int k : {ADD, MUL})
          if (on[k]) out.push_back(binary(k, i, j));
      if (i != j) {
        if (on[DIV]) out.push_back(binary(DIV, i, j));
        if (on[SUB]) out.push_back(binary(SUB, i, j));
        if (on[CONCAT] && sh[i].size() == sh[j].size())
          for (int d = 0; d < nd; ++d) {
            Move m = binary(CONCAT, i, j);
            m.form = DIM; m.dim = d; m.n_rank = 1; m.rank_attrs[0] = d;
            out.push_back(m);
          }
      }
      if (on[MATMUL]) out.push_back(binary(MATMUL, i, j));
      if (on[MATMUL_T] && sh[j].size() >= 2) out.push_back(binary(MATMUL_T, i, j));
      if (on[ACC_ONLINE_SOFTMAX] && i != j && flags[i] == 0) out.push_back(binary(ACC_ONLINE_SOFTMAX, i, j));
    }
  }
  if (!on[CONCAT_MATMUL]) return;
  // (a ‖ b) @ (c ‖ d): a != b, c != d, equal flags, shapes that fit (generate.py: concat_matmuls)
  for (int a = 0; a < n; ++a)
    for (int b = 0; b < n; ++b) {
      if (a == b || flags[a] != flags[b] || sh[a].size() < 2 || sh[a].size() != sh[b].size() ||
          !std::equal(sh[a].begin(), sh[a].end() - 1, sh[b].begin()))
        continue;
      const long inner = sh[a].back() + sh[b].back();
      for (int c = 0; c < n; ++c)
        for (int d = 0; d < n; ++d) {
          if (c == d || flags[c] != flags[a] || flags[d] != flags[a] || sh[c].size() != sh[d].size() ||
              sh[c].size() < 2 || sh[c].back() != sh[d].back() ||
              sh[c][sh[c].size() - 2] + sh[d][sh[d].size() - 2] != inner)
            continue;
          out.push_back(Move{CONCAT_MATMUL, 4, {a, b, c, d}, NO_ATTRS, 0, -1, 0, {0, 0}});
        }
    }
}

PyObject* pair(PyObject* name, PyObject* value) { return PyTuple_Pack(2, name, value); }

// The attrs tuple of a move, as generate.py writes it: sorted (name, value) pairs.
PyObject* attrs_of(const Move& m, PyObject* eps_values, PyObject* scale_values) {
  switch (m.form) {
    case NO_ATTRS:
      return PyTuple_New(0);
    case VALUE: {
      Ref p(pair(s_value, PyTuple_GET_ITEM(scale_values, m.eps)));
      return p.p ? PyTuple_Pack(1, p.p) : nullptr;
    }
    case EPS: {
      Ref p(pair(s_eps, PyTuple_GET_ITEM(eps_values, m.eps)));
      return p.p ? PyTuple_Pack(1, p.p) : nullptr;
    }
    case DIM_NONE: {
      Ref p(pair(s_dim, Py_None));
      return p.p ? PyTuple_Pack(1, p.p) : nullptr;
    }
    case DIM: {
      Ref d(PyLong_FromLong(m.dim));
      if (!d.p) return nullptr;
      Ref p(pair(s_dim, d.p));
      return p.p ? PyTuple_Pack(1, p.p) : nullptr;
    }
    case DIM_EPS: {
      Ref d(PyLong_FromLong(m.dim));
      if (!d.p) return nullptr;
      Ref p1(pair(s_dim, d.p));
      Ref p2(pair(s_eps, PyTuple_GET_ITEM(eps_values, m.eps)));
      return p1.p && p2.p ? PyTuple_Pack(2, p1.p, p2.p) : nullptr;
    }
  }
  return nullptr;
}

// A tuple of items[ins[k]] (borrowed from a list).
PyObject* gather(PyObject* list, const Move& m) {
  PyObject* t = PyTuple_New(m.n_in);
  if (!t) return nullptr;
  for (int k = 0; k < m.n_in; ++k) {
    PyObject* o = PyList_GET_ITEM(list, m.ins[k]);
    Py_INCREF(o);
    PyTuple_SET_ITEM(t, k, o);
  }
  return t;
}

// memo.get(key); on a miss, memo[key] = miss(*args). Returns a new reference (None included).
PyObject* memo_get(PyObject* memo, PyObject* key, PyObject* miss, PyObject* args, bool none_is_miss) {
  PyObject* hit = PyDict_GetItemWithError(memo, key);
  if (hit && !(none_is_miss && hit == Py_None)) {
    Py_INCREF(hit);
    return hit;
  }
  if (PyErr_Occurred()) return nullptr;
  PyObject* v = PyObject_CallObject(miss, args);
  if (!v) return nullptr;
  if (PyDict_SetItem(memo, key, v) < 0) {
    Py_DECREF(v);
    return nullptr;
  }
  return v;
}

bool read_state(PyObject* shapes, PyObject* flags, std::vector<std::vector<long>>& sh, std::vector<long>& fl) {
  const Py_ssize_t n = PyList_GET_SIZE(shapes);
  if (PyList_GET_SIZE(flags) != n) {
    PyErr_SetString(PyExc_ValueError, "search core: the state's shapes and flags differ in length");
    return false;
  }
  sh.resize(n);
  fl.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    Ref seq(PySequence_Fast(PyList_GET_ITEM(shapes, i), "search core: a value's shape is not a sequence"));
    if (!seq.p) return false;
    const Py_ssize_t nd = PySequence_Fast_GET_SIZE(seq.p);
    sh[i].resize(nd);
    for (Py_ssize_t d = 0; d < nd; ++d) sh[i][d] = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq.p, d));
    fl[i] = PyLong_AsLong(PyList_GET_ITEM(flags, i));
  }
  return !PyErr_Occurred();
}

PyObject* children(PyObject*, PyObject* args) {
  PyObject *env, *last, *share;
  if (!PyArg_ParseTuple(args, "O!OO:children", &PyTuple_Type, &env, &last, &share)) return nullptr;
  PyObject *names, *enabled, *eps_values, *scale_values, *shapes, *dtypes, *flags, *exprs, *op_memo, *expr_memo,
      *make_miss, *expr_miss;
  if (!PyArg_ParseTuple(env, "O!O!O!O!O!O!O!O!O!O!OO:children env", &PyTuple_Type, &names, &PyTuple_Type, &enabled,
                        &PyTuple_Type, &eps_values, &PyTuple_Type, &scale_values, &PyList_Type, &shapes, &PyList_Type,
                        &dtypes, &PyList_Type, &flags, &PyList_Type, &exprs, &PyDict_Type, &op_memo, &PyDict_Type,
                        &expr_memo, &make_miss, &expr_miss))
    return nullptr;
  if (PyTuple_GET_SIZE(names) != N_KINDS || PyTuple_GET_SIZE(enabled) != N_KINDS) {
    PyErr_Format(PyExc_ValueError, "search core: expected %d op kinds (KIND_ORDER), got %zd", N_KINDS,
                 PyTuple_GET_SIZE(names));
    return nullptr;
  }
  bool on[N_KINDS];
  for (int k = 0; k < N_KINDS; ++k) {
    const char* name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(names, k));
    if (!name) return nullptr;
    if (std::string_view(name) != KIND_NAMES[k]) {
      PyErr_Format(PyExc_ValueError, "search core: KIND_ORDER[%d] is %s, the core knows %s: rebuild torch_mirage._C",
                   k, name, KIND_NAMES[k]);
      return nullptr;
    }
    on[k] = PyObject_IsTrue(PyTuple_GET_ITEM(enabled, k)) == 1;
  }
  std::vector<double> eps(PyTuple_GET_SIZE(eps_values));
  for (size_t e = 0; e < eps.size(); ++e) eps[e] = PyFloat_AsDouble(PyTuple_GET_ITEM(eps_values, e));
  std::vector<double> scales(PyTuple_GET_SIZE(scale_values));
  for (size_t c = 0; c < scales.size(); ++c) scales[c] = PyFloat_AsDouble(PyTuple_GET_ITEM(scale_values, c));
  Rank rank;
  if (PyErr_Occurred() || !parse_rank(last, &rank)) return nullptr;
  long share_k = 0, share_n = 1, share_base = 0;
  const bool shared = share != Py_None;
  if (shared && !PyArg_ParseTuple(share, "lll:share", &share_k, &share_n, &share_base)) return nullptr;
  if (share_n < 1) {
    PyErr_Format(PyExc_ValueError, "search core: share (k, n) needs n >= 1, got n = %ld", share_n);
    return nullptr;
  }
  std::vector<std::vector<long>> sh;
  std::vector<long> fl;
  if (!read_state(shapes, flags, sh, fl)) return nullptr;
  if (PyList_GET_SIZE(dtypes) != static_cast<Py_ssize_t>(sh.size()) ||
      PyList_GET_SIZE(exprs) != static_cast<Py_ssize_t>(sh.size())) {
    PyErr_SetString(PyExc_ValueError, "search core: the state's shapes, dtypes and exprs differ in length");
    return nullptr;
  }

  std::vector<Move> all;
  enumerate_moves(sh, fl, on, eps, scales, all);
  std::vector<Move> moves;
  moves.reserve(all.size());
  for (const Move& m : all)
    if (cmp(m, rank) > 0) moves.push_back(m);
  std::stable_sort(moves.begin(), moves.end(), [](const Move& a, const Move& b) { return cmp(a, b) < 0; });

  Ref out(PyList_New(0));
  if (!out.p) return nullptr;
  for (size_t idx = 0; idx < moves.size(); ++idx) {
    const Move& m = moves[idx];
    if (shared && (share_base + static_cast<long>(idx) + 1) % share_n != share_k) continue;
    PyObject* kind = PyTuple_GET_ITEM(names, m.kind);
    Ref ins(PyTuple_New(m.n_in));
    if (!ins.p) return nullptr;
    for (int k = 0; k < m.n_in; ++k) {
      PyObject* v = PyLong_FromLong(m.ins[k]);
      if (!v) return nullptr;
      PyTuple_SET_ITEM(ins.p, k, v);
    }
    Ref attrs(attrs_of(m, eps_values, scale_values));
    Ref shs(gather(shapes, m)), dts(gather(dtypes, m));
    if (!attrs.p || !shs.p || !dts.p) return nullptr;
    Ref op_key(PyTuple_Pack(4, kind, attrs.p, shs.p, dts.p));
    if (!op_key.p) return nullptr;
    Ref op(memo_get(op_memo, op_key.p, make_miss, op_key.p, false));   // make_miss(kind, attrs, shapes, dtypes)
    if (!op.p) return nullptr;
    if (op.p == Py_None) continue;
    Ref xs(gather(exprs, m));
    if (!xs.p) return nullptr;
    Ref e_key(PyTuple_Pack(4, kind, attrs.p, xs.p, shs.p));
    Ref e_args(PyTuple_Pack(4, kind, xs.p, shs.p, op.p));                // expr_miss(kind, args, shapes, op)
    if (!e_key.p || !e_args.p) return nullptr;
    Ref e(memo_get(expr_memo, e_key.p, expr_miss, e_args.p, true));
    if (!e.p) return nullptr;
    Ref row(Py_BuildValue("(nOOOOO)", static_cast<Py_ssize_t>(idx), kind, ins.p, attrs.p, op.p, e.p));
    if (!row.p || PyList_Append(out.p, row.p) < 0) return nullptr;
  }
  return Py_BuildValue("(Nn)", out.release(), static_cast<Py_ssize_t>(moves.size()));
}

PyMethodDef methods[] = {
    {"children", children, METH_VARARGS,
     "children(env, last_rank, share) -> ([(index, kind, inputs, attrs, block op, expression)], number of moves): "
     "one step of the search generator's DFS (generate.py: py_children)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "torch_mirage._C",
                      "C++ cores of the μGraph search's measured hot loops (csrc/).", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C() {
  s_dim = PyUnicode_InternFromString("dim");
  s_eps = PyUnicode_InternFromString("eps");
  s_value = PyUnicode_InternFromString("value");
  if (!s_dim || !s_eps || !s_value) return nullptr;
  PyObject* m = PyModule_Create(&module);
  if (!m) return nullptr;
  if (PyModule_AddIntConstant(m, "ABI", ABI) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
