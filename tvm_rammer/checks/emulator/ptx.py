"""Inline PTX in generated CUDA -> calls of the CPU emulation (``include/rammer_emu_mma.h``).

:func:`translate` takes the CUDA source TVM generated (a ``str``) and returns it with every inline
asm statement it knows rewritten into C++ (one ``do { ... } while (0)`` block per statement, on as
many lines as the statement had, so compiler diagnostics keep their line numbers). Every asm
statement with PTX it does not know raises :class:`EmulatorError` quoting the statement: the
emulator never compiles PTX it cannot run, and never silently skips it. The calls need
``rammer_emu_mma.h``, which the build's force-included ``rammer_emu.h`` includes after the runtime
(the header's warp collectives are ``rammer_emu::warp_collective`` groups, one static site object
per translated statement). ``build.py`` runs :func:`translate` after its own rewrite of named
barriers (``bar.sync``); the other asm of tvm-rammer's helpers sits in ``#else`` branches of
``#ifdef RAMMER_EMULATE`` and is never translated (without such a branch it is refused).

Inventory (TVM 0.27, sm_90a): the fp16 tensor-core rKernel versions of
``tir_templates/mma_templates.py`` (every version of conv_s2, conv_11x11_s4, conv_1x1, grouped,
matmul, dense_b8) emit only ``ldmatrix.sync.aligned.m8n8.x4.shared.b16`` and
``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32``; with asynchronous pipeline stages
(``software_pipeline_async_stages``, not used by our templates) TVM adds ``cp.async.cg.shared.global``
(16 bytes), ``cp.async.commit_group`` and ``cp.async.wait_group N``; TVM's default pipeline on the
fp16 models (alexnet, resnext29, branches, lstm_tc, two_branch, a 256^3 matmul) emits no asm (its
preamble includes ``<mma.h>``, a fake header here: the wmma API is not emulated).

Known PTX (what TVM's CUDA code generation emits for tensor cores and its asynchronous copies):
``ldmatrix.sync.aligned.m8n8.x1/.x2/.x4{.trans}.shared{::cta}.b16``;
``mma.sync.aligned.m16n8k16`` and ``.m16n8k8`` ``.row.col`` with f16/bf16 A and B and f32 or f16
C/D; ``cp.async.ca/.cg.shared{::cta}.global`` (cache and prefetch qualifiers ignored) with and
without a src-size operand (zero fill), ``cp.async.commit_group``, ``cp.async.wait_group N``,
``cp.async.wait_all``; inside ``{ ... }`` blocks: ``.reg .pred/.b32/.u32/.b64/.u64/.f32``
declarations, ``setp.{eq,ne,lt,le,gt,ge}.{b,u,s}{32,64}``, ``@p`` / ``@!p`` guards,
``st.shared{.v2,.v4}.{b,u,s}32`` (TVM's zero fill of a predicated cp.async), ``mov`` of 32/64-bit
values and of ``%laneid``, ``ld.global{.nc}`` of 32-bit values (TVM's predicated ``ldg32``); an
empty template (a compiler barrier) stays an empty, portable asm. Operands follow the GNU
constraints: ``=r``/``+r``/``r`` (32-bit), ``h`` (16), ``l`` (64, pointers), ``f`` (float), ``d``
(double), ``n`` (immediate), named ``[x]`` operands too.

Preprocessor conditionals (the choice the issue asks to state): the source is not run through
the C preprocessor (that would pull system headers, with their ``__asm__("" "symbol")`` renames,
into the text). Instead the ``#if/#ifdef/#ifndef/#elif/#else/#endif`` lines are evaluated with
three-valued logic: ``defines`` (default ``{"RAMMER_EMULATE": "1"}``, what the emulator's build
defines; the fake CUDA headers also define ``__CUDA_ARCH__`` 900 and ``__CUDACC_VER_*`` 12.8, which
a caller may pass) and ``undefined`` (default: none) are known, ``#define``/``#undef`` lines of the source
are tracked, every other macro (``__CUDA_ARCH__``, ``__CUDACC_VER_MAJOR__``, ...) is unknown. An
asm statement in a region known to be inactive (the ``#else`` of ``#ifdef RAMMER_EMULATE`` in
tvm_rammer/codegen/cuda_helpers.py) is left alone; one in an active or unknown region is
translated or rejected (an unknown region's unknown PTX is an error naming the condition: fail
closed). Conditionals *inside* an asm statement (older TVM put ``#if TVM_ENABLE_L2_PREFETCH``
between template strings) are kept: each branch's statement is translated and the directives
stay around the translations. An asm in a ``#define`` body of a live region is an error. asm
labels (``int f(int) __asm__("name");``: no qualifier, no operands, a symbol-name template after
a ``)``) are declarations, not PTX, and are left alone.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import EmulatorError  # build.py re-exports it (build imports this module)

__all__ = ["translate", "find_asm", "AsmStatement", "EmulatorError", "DEFAULT_DEFINES", "HEADER"]

HEADER = "rammer_emu_mma.h"
DEFAULT_DEFINES = {"RAMMER_EMULATE": "1"}

_ASM_KEYWORDS = ("asm", "__asm__", "__asm")
_QUALIFIERS = ("volatile", "__volatile__", "__volatile", "inline", "__inline", "__inline__", "goto")
_IDENT = re.compile(r"[A-Za-z_]\w*")
# what find_asm stops at: a literal, a comment, a directive, an asm keyword (not inside a name)
_INTERESTING = re.compile(r"[\"'/#]|(?<![\w$])(?:__asm__|__asm|asm)(?![\w$])")


# ================================================================= lexing of the C++ source

def _skip_literal(src: str, i: int) -> int:
    """Index just past the string or char literal starting at src[i] (a quote)."""
    quote, n = src[i], len(src)
    i += 1
    while i < n and src[i] != quote:
        if src[i] == "\\":
            i += 1
        elif src[i] == "\n":  # unterminated: stop at the line's end
            return i
        i += 1
    return i + 1


def _skip_comment(src: str, i: int) -> int:
    """Index past the comment at src[i] ('//' or '/*'); i itself if there is none."""
    if src.startswith("//", i):
        end = src.find("\n", i)
        return len(src) if end < 0 else end
    if src.startswith("/*", i):
        end = src.find("*/", i + 2)
        return len(src) if end < 0 else end + 2
    return i


def _directive_end(src: str, i: int) -> int:
    """End (index of the newline, or len) of the preprocessor line starting at i, continuations
    and comments included."""
    n = len(src)
    while i < n:
        ch = src[i]
        if ch == "\\" and src.startswith("\n", i + 1):
            i += 2
        elif ch == "\\" and src.startswith("\r\n", i + 1):
            i += 3
        elif ch == "\n":
            return i
        elif ch in "\"'":
            i = _skip_literal(src, i)
        elif src.startswith("/*", i) or src.startswith("//", i):
            j = _skip_comment(src, i)
            if src.startswith("//", i):
                return j
            i = j
        else:
            i += 1
    return n


def _at_line_start(src: str, i: int) -> bool:
    j = i - 1
    while j >= 0 and src[j] in " \t":
        j -= 1
    return j < 0 or src[j] == "\n"


def _strip_comments(text: str) -> str:
    out, i, n = [], 0, len(text)
    while i < n:
        if text[i] in "\"'":
            j = _skip_literal(text, i)
            out.append(text[i:j])
            i = j
            continue
        j = _skip_comment(text, i)
        if j != i:
            out.append(" ")
            i = j
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


# ================================================================ three-valued #if evaluation

class _Unknown:
    """A value the preprocessor cannot decide here (an unknown macro)."""


UNKNOWN = _Unknown()


def _tri_and(a, b):
    if a is False or b is False:
        return False
    return UNKNOWN if UNKNOWN in (a, b) else True


def _tri_not(a):
    return UNKNOWN if a is UNKNOWN else not a


_PP_TOKEN = re.compile(r"\s*(?:(0[xX][0-9a-fA-F]+|\d+)[uUlL]*|([A-Za-z_]\w*)"
                       r"|(&&|\|\||==|!=|<=|>=|<<|>>|[-+*/%<>!~&|^?:()]))")


class _Macros:
    """Macro knowledge: {name: value string} defined, a set known undefined, the rest unknown."""

    def __init__(self, defines, undefined):
        self.defined = {k: str(v) for k, v in defines.items()}
        self.undefined = set(undefined)
        self.unknown = set()

    def is_defined(self, name):
        if name in self.defined:
            return True
        if name in self.undefined:
            return False
        return UNKNOWN

    def value(self, name, depth=0):
        state = self.is_defined(name)
        if state is False:
            return 0
        if state is UNKNOWN or depth > 8:
            return UNKNOWN
        text = self.defined[name].strip() or "1"
        try:
            return _PPExpr(text, self, depth + 1).parse()
        except (ValueError, IndexError):
            return UNKNOWN

    def define(self, name, value, certain):
        if certain:
            self.defined[name] = value
            self.undefined.discard(name)
        else:
            self.defined.pop(name, None)
            self.undefined.discard(name)

    def undef(self, name, certain):
        self.defined.pop(name, None)
        if certain:
            self.undefined.add(name)
        else:
            self.undefined.discard(name)


class _PPExpr:
    """Recursive-descent evaluation of a #if expression; UNKNOWN propagates (&& and || short-cut)."""

    def __init__(self, text, macros, depth=0):
        self.toks, pos = [], 0
        text = text.strip()
        while pos < len(text):
            m = _PP_TOKEN.match(text, pos)
            if not m or m.end() == pos:
                raise ValueError(f"cannot read #if expression {text!r}")
            if m.group(1):
                self.toks.append(("num", int(m.group(1), 0)))
            elif m.group(2):
                self.toks.append(("id", m.group(2)))
            else:
                self.toks.append(("op", m.group(3)))
            pos = m.end()
            while pos < len(text) and text[pos].isspace():
                pos += 1
        self.i, self.macros, self.depth = 0, macros, depth

    def parse(self):
        value = self.ternary()
        if self.i != len(self.toks):
            raise ValueError("trailing tokens in #if expression")
        return value

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else (None, None)

    def take(self, op=None):
        tok = self.peek()
        if op is not None and tok != ("op", op):
            raise ValueError(f"expected {op!r}")
        self.i += 1
        return tok

    def ternary(self):
        cond = self.binary(0)
        if self.peek() == ("op", "?"):
            self.take("?")
            a = self.ternary()
            self.take(":")
            b = self.ternary()
            if cond is UNKNOWN:
                return a if a == b and a is not UNKNOWN else UNKNOWN
            return a if cond else b
        return cond

    _LEVELS = [("||",), ("&&",), ("|",), ("^",), ("&",), ("==", "!="), ("<", "<=", ">", ">="),
               ("<<", ">>"), ("+", "-"), ("*", "/", "%")]

    def binary(self, level):
        if level == len(self._LEVELS):
            return self.unary()
        left = self.binary(level + 1)
        while self.peek()[0] == "op" and self.peek()[1] in self._LEVELS[level]:
            op = self.take()[1]
            right = self.binary(level + 1)
            left = self._apply(op, left, right)
        return left

    @staticmethod
    def _apply(op, a, b):
        if op == "&&":
            if a is UNKNOWN or b is UNKNOWN:
                return 0 if 0 in (a, b) else UNKNOWN
            return int(bool(a) and bool(b))
        if op == "||":
            if a is UNKNOWN or b is UNKNOWN:
                return 1 if any(v is not UNKNOWN and v for v in (a, b)) else UNKNOWN
            return int(bool(a) or bool(b))
        if a is UNKNOWN or b is UNKNOWN:
            return UNKNOWN
        if op in ("/", "%") and b == 0:
            raise ValueError("division by zero in #if")
        return {"|": lambda: a | b, "^": lambda: a ^ b, "&": lambda: a & b,
                "==": lambda: int(a == b), "!=": lambda: int(a != b), "<": lambda: int(a < b),
                "<=": lambda: int(a <= b), ">": lambda: int(a > b), ">=": lambda: int(a >= b),
                "<<": lambda: a << b, ">>": lambda: a >> b, "+": lambda: a + b, "-": lambda: a - b,
                "*": lambda: a * b, "/": lambda: int(a / b), "%": lambda: a % b}[op]()

    def unary(self):
        kind, val = self.peek()
        if kind == "op" and val in ("!", "~", "-", "+"):
            self.take()
            v = self.unary()
            if v is UNKNOWN:
                return UNKNOWN
            return {"!": int(not v), "~": ~v, "-": -v, "+": v}[val]
        if kind == "op" and val == "(":
            self.take("(")
            v = self.ternary()
            self.take(")")
            return v
        if kind == "num":
            self.take()
            return val
        if kind == "id":
            self.take()
            if val == "defined":
                paren = self.peek() == ("op", "(")
                if paren:
                    self.take("(")
                name = self.take()[1]
                if paren:
                    self.take(")")
                d = self.macros.is_defined(name)
                return UNKNOWN if d is UNKNOWN else int(d)
            if val in ("true", "false"):
                return int(val == "true")
            if self.peek() == ("op", "("):  # function-like macro call: cannot evaluate
                depth = 0
                while self.i < len(self.toks):
                    tok = self.take()
                    depth += tok == ("op", "(")
                    depth -= tok == ("op", ")")
                    if depth == 0:
                        break
                return UNKNOWN
            return self.macros.value(val, self.depth)
        raise ValueError("bad #if expression")


def _eval_condition(expr: str, macros: _Macros):
    try:
        v = _PPExpr(_strip_comments(expr), macros).parse()
    except (ValueError, IndexError, KeyError):
        return UNKNOWN
    return UNKNOWN if v is UNKNOWN else bool(v)


@dataclass
class _Frame:
    outer: object      # activity of the enclosing region (True / False / UNKNOWN)
    branch: object     # this branch's condition
    taken: object      # whether an earlier branch was taken
    text: str          # the directive text, for messages


class _Conditionals:
    """The #if stack while scanning a source."""

    def __init__(self, macros):
        self.macros, self.stack = macros, []

    @property
    def active(self):
        state = True
        for frame in self.stack:
            state = _tri_and(state, _tri_and(frame.outer, frame.branch))
        return state

    def describe(self):
        return " / ".join(f.text for f in self.stack if f.branch is not True) or "(none)"

    def directive(self, line: str, where: str):
        body = _strip_comments(line.replace("\\\r\n", " ").replace("\\\n", " ")).strip()[1:].strip()
        m = re.match(r"(\w+)\s*(.*)", body, re.S)
        if not m:
            return
        name, rest = m.group(1), m.group(2).strip()
        outer = self.active
        if name in ("if", "ifdef", "ifndef"):
            if name == "if":
                cond = _eval_condition(rest, self.macros)
            else:
                d = self.macros.is_defined(rest.split()[0]) if rest else UNKNOWN
                cond = d if name == "ifdef" else _tri_not(d)
            self.stack.append(_Frame(outer, cond, cond, f"#{name} {rest}"))
        elif name in ("elif", "else", "elifdef", "elifndef"):
            if not self.stack:
                raise EmulatorError(f"#{name} without #if {where}")
            frame = self.stack[-1]
            if name == "else":
                cond = True
            elif name == "elif":
                cond = _eval_condition(rest, self.macros)
            else:
                d = self.macros.is_defined(rest.split()[0]) if rest else UNKNOWN
                cond = d if name == "elifdef" else _tri_not(d)
            branch = _tri_and(_tri_not(frame.taken), cond)
            taken = True if frame.taken is True or cond is True else (
                False if frame.taken is False and cond is False else UNKNOWN)
            self.stack[-1] = _Frame(frame.outer, branch, taken, f"#{name} {rest}".strip() + f" (of {frame.text})")
        elif name == "endif":
            if not self.stack:
                raise EmulatorError(f"#endif without #if {where}")
            self.stack.pop()
        elif name == "define" and outer is not False:
            m2 = re.match(r"([A-Za-z_]\w*)(\([^)]*\))?\s*(.*)", rest, re.S)
            if m2:
                self.macros.define(m2.group(1), "" if m2.group(2) else m2.group(3),
                                   certain=outer is True and not m2.group(2))
        elif name == "undef" and outer is not False and rest:
            self.macros.undef(rest.split()[0], certain=outer is True)


# ====================================================================== asm statements

@dataclass(frozen=True)
class Operand:
    """One asm operand: its constraint ("=r", "+f", "n", ...), C++ expression and [name]."""

    constraint: str
    expr: str
    name: str = ""

    @property
    def is_output(self) -> bool:
        return self.constraint.startswith(("=", "+"))

    @property
    def letter(self) -> str:
        return self.constraint.lstrip("=+&")[:1]


@dataclass
class AsmStatement:
    """An inline asm statement found in a source: its text, position and parse."""

    text: str
    start: int
    end: int
    line: int
    active: object = True            # True / False / UNKNOWN: the preprocessor region
    condition: str = ""               # the conditions of an UNKNOWN region
    template: str = ""                # the PTX (string literals joined and unescaped)
    outputs: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    clobbers: list = field(default_factory=list)
    qualifiers: tuple = ()
    is_label: bool = False            # an asm label of a declaration (left alone)


def _unescape(literal: str) -> str:
    body = literal[1:-1]
    out, i = [], 0
    escapes = {"n": "\n", "t": "\t", "\\": "\\", '"': '"', "'": "'", "r": "\r", "0": "\0", "a": "\a",
               "v": "\v", "f": "\f", "b": "\b", "?": "?"}
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            out.append(escapes.get(body[i + 1], body[i + 1]))
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def split_top(text: str, sep: str) -> list:
    """Split at `sep` characters outside strings, comments and (), [], {} nesting."""
    parts, depth, cur, i, n = [], 0, [], 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "\"'":
            j = _skip_literal(text, i)
            cur.append(text[i:j])
            i = j
            continue
        j = _skip_comment(text, i)
        if j != i:
            cur.append(" ")
            i = j
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
        i += 1
    parts.append("".join(cur))
    return parts


_OPERAND = re.compile(r'\s*(?:\[\s*(\w+)\s*\])?\s*"([^"]*)"\s*\((.*)\)\s*$', re.S)


def _parse_operands(text: str, stmt: str) -> list:
    if not text.strip():
        return []
    ops = []
    for part in split_top(text, ","):
        m = _OPERAND.match(part)
        if not m:
            raise EmulatorError(f"cannot read the asm operand {part.strip()!r} of:\n{stmt}")
        ops.append(Operand(m.group(2).replace(" ", ""), m.group(3).strip(), m.group(1) or ""))
    return ops


def _parse_statement(stmt: AsmStatement, source: str) -> None:
    """Fill template/operands of `stmt` (its text: keyword qualifiers ( ... ))."""
    text = stmt.text
    open_paren = text.index("(")
    head = _strip_comments(text[:open_paren]).split()
    stmt.qualifiers = tuple(h for h in head[1:])
    inner = text[open_paren + 1:text.rindex(")")]
    sections = split_top(inner, ":")
    literals = []
    rest = _strip_comments(sections[0]).strip()
    while rest:
        if rest[0] != '"':
            raise EmulatorError("inline asm whose template is not only string literals (a macro?) "
                                f"cannot be emulated:\n{text}")
        j = _skip_literal(rest, 0)
        literals.append(_unescape(rest[:j]))
        rest = rest[j:].strip()
    stmt.template = "".join(literals)
    if len(sections) > 5:
        raise EmulatorError(f"cannot read the asm statement (too many ':' sections):\n{text}")
    stmt.outputs = _parse_operands(sections[1], text) if len(sections) > 1 else []
    stmt.inputs = _parse_operands(sections[2], text) if len(sections) > 2 else []
    stmt.clobbers = [c.strip() for c in sections[3].split(",") if c.strip()] if len(sections) > 3 else []
    if len(sections) == 1 and not stmt.qualifiers and re.fullmatch(r"[A-Za-z_.$][\w.$@]*", stmt.template):
        j = stmt.start - 1
        while j >= 0 and source[j].isspace():
            j -= 1
        stmt.is_label = j >= 0 and source[j] in ")]"


def _match_paren(src: str, i: int) -> tuple:
    """(index past the ')' matching src[i] == '(', directive lines inside) ."""
    depth, n, directives = 0, len(src), []
    while i < n:
        ch = src[i]
        if ch in "\"'":
            i = _skip_literal(src, i)
            continue
        j = _skip_comment(src, i)
        if j != i:
            i = j
            continue
        if ch == "#" and _at_line_start(src, i):
            end = _directive_end(src, i)
            directives.append((i, end))
            i = end
            continue
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i + 1, directives
        i += 1
    raise EmulatorError("unbalanced parentheses in an inline asm statement:\n" + src[:200])


def _asm_open_paren(src: str, i: int) -> int:
    """Index of the '(' of the asm whose keyword ends at i (qualifiers skipped), or -1."""
    n = len(src)
    while i < n:
        while i < n and src[i].isspace():
            i += 1
        j = _skip_comment(src, i)
        if j != i:
            i = j
            continue
        if i < n and src[i] == "(":
            return i
        m = _IDENT.match(src, i)
        if m and m.group(0) in _QUALIFIERS:
            i = m.end()
            continue
        return -1
    return -1


def find_asm(source: str, defines=None, undefined=()) -> list:
    """Every inline asm statement of `source` (``asm``/``__asm__``/``__asm`` with qualifiers and a
    parenthesised body), with its preprocessor region's activity (see the module docstring).

    Raises EmulatorError for an asm statement inside a ``#define`` body of a region that is not
    known to be inactive (it cannot be translated where it is)."""
    macros = _Macros(DEFAULT_DEFINES if defines is None else defines, undefined)
    conds = _Conditionals(macros)
    found, i, line = [], 0, 1
    while True:
        m = _INTERESTING.search(source, i)  # jump over text that cannot start anything of interest
        if not m:
            break
        line += source.count("\n", i, m.start())
        i = m.start()
        ch = source[i]
        if ch in "\"'":
            j = _skip_literal(source, i)
            line += source.count("\n", i, j)
            i = j
            continue
        if ch == "/":
            j = _skip_comment(source, i)
            line += source.count("\n", i, j)
            i = max(j, i + 1)
            continue
        if ch == "#":
            if not _at_line_start(source, i):
                i += 1
                continue
            end = _directive_end(source, i)
            text = source[i:end]
            where = f"(line {line})"
            if re.match(r"#\s*define\b", text) and conds.active is not False:
                for mm in re.finditer(r"\b(?:__asm__|__asm|asm)\b", _strip_comments(text)):
                    if _asm_open_paren(_strip_comments(text), mm.end()) >= 0:
                        raise EmulatorError(f"inline asm inside a macro definition {where} cannot be "
                                            f"emulated (translate it where the macro is used):\n{text}")
            conds.directive(text, where)
            line += text.count("\n")
            i = end
            continue
        keyword = m.group(0)
        paren = _asm_open_paren(source, i + len(keyword))
        if paren < 0:
            i += len(keyword)
            continue
        end, _ = _match_paren(source, paren)
        found.append(AsmStatement(source[i:end], i, end, line, conds.active,
                                  conds.describe() if conds.active is UNKNOWN else ""))
        line += source.count("\n", i, end)
        i = end
    if conds.stack:
        raise EmulatorError(f"unterminated {conds.stack[-1].text} in the CUDA source")
    return found


# ======================================================================= PTX -> C++

_C_TYPES = {"r": "uint32_t", "h": "uint16_t", "l": "uint64_t", "f": "float", "d": "double",
            "n": "long long", "i": "long long"}
_REG_TYPES = {"pred": "bool", "b32": "uint32_t", "u32": "uint32_t", "s32": "int32_t",
              "b64": "uint64_t", "u64": "uint64_t", "s64": "int64_t", "f32": "float",
              "b16": "uint16_t", "u16": "uint16_t"}


class _Unsupported(Exception):
    """PTX this module cannot emulate (message: what)."""


@dataclass
class _Ctx:
    """Translation state of one asm statement."""

    stmt: AsmStatement
    operands: list
    names: dict
    counter: list
    locals: dict = field(default_factory=dict)  # PTX register name -> C type

    def operand(self, token: str) -> tuple:
        """(C++ name, C type) of a PTX operand token: %N, %[name], a declared register."""
        token = token.strip()
        m = re.fullmatch(r"%(\d+)|%\[(\w+)\]", token)
        if m:
            idx = int(m.group(1)) if m.group(1) is not None else self.names.get(m.group(2))
            if idx is None or idx >= len(self.operands):
                raise _Unsupported(f"operand {token} does not exist")
            op = self.operands[idx]
            return f"rammer_op{idx}", _C_TYPES.get(op.letter, "")
        if token in self.locals:
            return f"rammer_r_{token.replace('%', 'p_')}", self.locals[token]
        raise _Unsupported(f"operand {token!r}")

    def value(self, token: str, ctype: str) -> str:
        """A C++ expression of type `ctype` for a PTX source operand (register or immediate)."""
        token = token.strip()
        if re.fullmatch(r"-?(0[xX][0-9a-fA-F]+|\d+)[uU]?", token):
            return f"(({ctype}){token.rstrip('uU')})"
        if token == "%laneid":
            return f"(({ctype})rammer_emu::lane_id())"
        name, _ = self.operand(token)
        return f"rammer_emu_mma::reg<{ctype}>({name})"

    def site(self) -> str:
        self.counter[0] += 1
        return f"rammer_ptx_site_{self.counter[0]}"


def _vector(token: str) -> list:
    token = token.strip()
    if not (token.startswith("{") and token.endswith("}")):
        raise _Unsupported(f"expected a register vector, got {token!r}")
    return [t.strip() for t in token[1:-1].split(",")]


def _address(token: str, ctx: _Ctx, ctype: str) -> str:
    token = token.strip()
    m = re.fullmatch(r"\[\s*([^\]+]+?)\s*(?:\+\s*(-?\d+)\s*)?\]", token)
    if not m:
        raise _Unsupported(f"address {token!r}")
    base = ctx.value(m.group(1), ctype)
    return f"({base} + ({ctype}){m.group(2)})" if m.group(2) else base


_LDMATRIX = re.compile(r"ldmatrix\.sync\.aligned\.m8n8\.x([124])(\.trans)?\.shared(?:::cta)?\.b16")
_MMA = re.compile(r"mma\.sync\.aligned\.m16n8k(8|16)\.row\.col\.(f32|f16|bf16)\.(f16|bf16)\.(f16|bf16)\.(f32|f16|bf16)")
_CP_ASYNC = re.compile(r"cp\.async\.(ca|cg)\.shared(?:::cta)?\.global((?:\.L2::(?:cache_hint|64B|128B|256B))*)")
_TYPES = {"f32": "rammer_emu_mma::F32", "f16": "rammer_emu_mma::F16", "bf16": "rammer_emu_mma::BF16"}


def _ldmatrix(m, args, ctx):
    num, trans = int(m.group(1)), bool(m.group(2))
    if len(args) != 2:
        raise _Unsupported("ldmatrix takes a register vector and an address")
    dsts = _vector(args[0])
    if len(dsts) != num:
        raise _Unsupported(f"ldmatrix .x{num} needs {num} destination registers")
    site = ctx.site()
    addr = _address(args[1], ctx, "uint32_t")
    lines = [f"static char {site}; uint32_t rammer_d[4];",
             f"rammer_emu_mma::ldmatrix(&{site}, {num}, {str(trans).lower()}, {addr}, rammer_d);"]
    for k, d in enumerate(dsts):
        name, _ = ctx.operand(d)
        lines.append(f"rammer_emu_mma::assign({name}, rammer_d[{k}]);")
    return "{ " + " ".join(lines) + " }"


def _mma(m, args, ctx):
    k, dt, at, bt, ct = int(m.group(1)), m.group(2), m.group(3), m.group(4), m.group(5)
    if at != bt:
        raise _Unsupported("mma with different A and B types")
    if len(args) != 4:
        raise _Unsupported("mma takes D, A, B, C")
    d, a, b, c = (_vector(x) for x in args)
    regs = lambda t: 4 if t == "f32" else 2  # noqa: E731
    if (len(a), len(b), len(d), len(c)) != (k // 4, k // 8, regs(dt), regs(ct)):
        raise _Unsupported("mma register counts do not match its shape and types")
    site = ctx.site()
    vec = lambda regs_: ", ".join(ctx.value(r, "uint32_t") for r in regs_)  # noqa: E731
    lines = [f"static char {site};",
             f"const uint32_t rammer_a[4] = {{{vec(a)}}}; const uint32_t rammer_b[2] = {{{vec(b)}}};",
             f"const uint32_t rammer_c[4] = {{{vec(c)}}}; uint32_t rammer_d[4];",
             f"rammer_emu_mma::mma(&{site}, {k}, {_TYPES[dt]}, {_TYPES[at]}, {_TYPES[bt]}, {_TYPES[ct]}, "
             "rammer_a, rammer_b, rammer_c, rammer_d);"]
    for i, r in enumerate(d):
        name, _ = ctx.operand(r)
        lines.append(f"rammer_emu_mma::assign({name}, rammer_d[{i}]);")
    return "{ " + " ".join(lines) + " }"


def _cp_async(m, args, ctx):
    if m.group(2) and "cache_hint" in m.group(2):
        if len(args) < 4:
            raise _Unsupported("cp.async .L2::cache_hint needs a cache-policy operand")
        args = args[:-1]  # the cache policy: a hint, nothing to emulate
    if len(args) not in (3, 4):
        raise _Unsupported("cp.async takes [dst], [src], cp-size{, src-size}")
    dst = _address(args[0], ctx, "uint32_t")
    src = _address(args[1], ctx, "uint64_t")
    size = ctx.value(args[2], "long long")
    src_size = ctx.value(args[3], "long long") if len(args) == 4 else size
    return f"rammer_emu_mma::cp_async({dst}, (const void*)(uintptr_t){src}, {size}, {src_size});"


def _commit(m, args, ctx):
    if args:
        raise _Unsupported("cp.async.commit_group takes no operand")
    return "rammer_emu_mma::cp_async_commit_group();"


def _wait_group(m, args, ctx):
    if len(args) != 1:
        raise _Unsupported("cp.async.wait_group takes one count")
    return f"rammer_emu_mma::cp_async_wait_group({ctx.value(args[0], 'long long')});"


def _wait_all(m, args, ctx):
    if args:
        raise _Unsupported("cp.async.wait_all takes no operand")
    return "rammer_emu_mma::cp_async_wait_all();"


_SETP_OPS = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_SCALAR = {"b32": "uint32_t", "u32": "uint32_t", "s32": "int32_t", "b64": "uint64_t",
           "u64": "uint64_t", "s64": "int64_t", "f32": "float"}


def _setp(m, args, ctx):
    op, ctype = _SETP_OPS[m.group(1)], _SCALAR[m.group(2)]
    if len(args) != 3:
        raise _Unsupported("setp takes p, a, b")
    name, kind = ctx.operand(args[0])
    if kind != "bool":
        raise _Unsupported("setp's destination must be a .pred register")
    return f"{name} = ({ctx.value(args[1], ctype)} {op} {ctx.value(args[2], ctype)});"


def _st_shared(m, args, ctx):
    count = int(m.group(1) or 1)
    if len(args) != 2:
        raise _Unsupported("st.shared takes [addr], value")
    values = _vector(args[1]) if count > 1 else [args[1]]
    if len(values) != count:
        raise _Unsupported(f"st.shared.v{count} needs {count} values")
    addr = _address(args[0], ctx, "uint32_t")
    vals = ", ".join(ctx.value(v, "uint32_t") for v in values)
    return (f"{{ const uint32_t rammer_v[{count}] = {{{vals}}}; "
            f"rammer_emu_mma::st_shared_u32({addr}, rammer_v, {count}); }}")


def _mov(m, args, ctx):
    ctype = _SCALAR[m.group(1)]
    if len(args) != 2:
        raise _Unsupported("mov takes dst, src")
    name, _ = ctx.operand(args[0])
    return f"rammer_emu_mma::assign({name}, {ctx.value(args[1], ctype)});"


def _ld_global(m, args, ctx):
    ctype = _SCALAR[m.group(1)]
    if len(args) != 2:
        raise _Unsupported("ld.global takes dst, [addr]")
    name, _ = ctx.operand(args[0])
    addr = _address(args[1], ctx, "uint64_t")
    return (f"{{ {ctype} rammer_v; std::memcpy(&rammer_v, (const void*)(uintptr_t){addr}, sizeof rammer_v); "
            f"rammer_emu_mma::assign({name}, rammer_v); }}")


_INSTRUCTIONS = [
    (_LDMATRIX, _ldmatrix),
    (_MMA, _mma),
    (_CP_ASYNC, _cp_async),
    (re.compile(r"cp\.async\.commit_group"), _commit),
    (re.compile(r"cp\.async\.wait_group"), _wait_group),
    (re.compile(r"cp\.async\.wait_all"), _wait_all),
    (re.compile(r"setp\.(eq|ne|lt|le|gt|ge)\.(b32|u32|s32|b64|u64|s64|f32)"), _setp),
    (re.compile(r"st\.shared(?:::cta)?(?:\.v(2|4))?\.(?:b32|u32|s32)"), _st_shared),
    (re.compile(r"mov\.(b32|u32|s32|f32|b64|u64|s64)"), _mov),
    (re.compile(r"ld\.global(?:\.nc)?\.(b32|u32|s32|f32)"), _ld_global),
]


def _instructions(template: str) -> list:
    """PTX statements of a template: ';'-separated, scope braces and comments removed."""
    text = re.sub(r"//[^\n]*", " ", template).replace("%%", "%")  # asm's %% is PTX's %
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    out = []
    for chunk in text.split(";"):
        chunk = chunk.strip()
        while chunk[:1] in ("{", "}"):
            chunk = chunk[1:].strip()
        if chunk:
            out.append(" ".join(chunk.split()))
    return out


def _translate_instruction(ins: str, ctx: _Ctx) -> str:
    guard = ""
    m = re.match(r"@(!?)(%?\w+)\s+(.*)", ins)
    if m:
        name, kind = ctx.operand(m.group(2))
        if kind != "bool":
            raise _Unsupported(f"guard {m.group(2)} is not a .pred register")
        guard = f"if ({'!' if m.group(1) else ''}{name}) "
        ins = m.group(3)
    m = re.match(r"\.reg\s+\.(\w+)\s+(.*)", ins)
    if m:
        ctype = _REG_TYPES.get(m.group(1))
        if ctype is None or guard:
            raise _Unsupported(f"register declaration {ins!r}")
        decls = []
        for reg_name in (r.strip() for r in m.group(2).split(",")):
            if not re.fullmatch(r"%?\w+", reg_name):
                raise _Unsupported(f"register declaration {ins!r}")
            ctx.locals[reg_name] = ctype
            cname, _ = ctx.operand(reg_name)
            decls.append(f"{ctype} {cname} = {ctype}();")
        return " ".join(decls)
    m = re.match(r"([A-Za-z_][\w.:]*)\s*(.*)", ins, re.S)  # "ldmatrix...b16{%0, ..." has no space
    if not m:
        raise _Unsupported(f"instruction {ins!r}")
    opcode, rest = m.group(1), m.group(2)
    args = [a.strip() for a in split_top(rest, ",")] if rest.strip() else []
    for pattern, handler in _INSTRUCTIONS:
        pm = pattern.fullmatch(opcode)
        if pm:
            return guard + handler(pm, args, ctx)
    raise _Unsupported(f"instruction {ins!r}")


def _translate_one(stmt: AsmStatement, counter: list) -> str:
    """C++ for one parsed asm statement without directives inside (raises _Unsupported)."""
    operands = stmt.outputs + stmt.inputs
    names = {op.name: k for k, op in enumerate(operands) if op.name}
    ctx = _Ctx(stmt, operands, names, counter)
    if not stmt.template.strip():  # an empty template: a compiler barrier, valid on any target
        return 'asm volatile("" ::: "memory")'
    body = []
    for k, op in enumerate(operands):
        ctype = _C_TYPES.get(op.letter)
        if ctype is None or (op.letter in "ni" and op.is_output):
            raise _Unsupported(f"operand constraint {op.constraint!r}")
        if op.constraint.startswith("="):
            body.append(f"{ctype} rammer_op{k} = {ctype}();")
        elif op.letter in "ni":
            body.append(f"const long long rammer_op{k} = (long long)({op.expr});")
        else:
            body.append(f"{ctype} rammer_op{k} = rammer_emu_mma::reg<{ctype}>({op.expr});")
    for ins in _instructions(stmt.template):
        body.append(_translate_instruction(ins, ctx))
    for k, op in enumerate(operands):
        if op.is_output:
            body.append(f"rammer_emu_mma::assign({op.expr}, rammer_op{k});")
    return "do { " + " ".join(body) + " } while (0)"


def _error(stmt: AsmStatement, why: str) -> EmulatorError:
    where = f"line {stmt.line} of the CUDA source"
    if stmt.active is UNKNOWN:
        where += f", under preprocessor conditions the emulator cannot decide ({stmt.condition})"
    return EmulatorError(f"the emulator cannot run this inline PTX ({why}; {where}); it knows "
                         "ldmatrix, mma.sync m16n8k8/k16, cp.async and their helpers "
                         f"(tvm_rammer/checks/emulator/ptx.py):\n{stmt.text}")


def _with_lines(code: str, original: str) -> str:
    """`code` on one line followed by as many newlines as `original` had."""
    return code + "\n" * original.count("\n")


def _translate_statement(stmt: AsmStatement, source: str, counter: list) -> str:
    _, directives = _match_paren(source, source.index("(", stmt.start))
    if not directives:
        _parse_statement(stmt, source)
        if stmt.is_label:
            return stmt.text
        try:
            return _with_lines(_translate_one(stmt, counter), stmt.text)
        except _Unsupported as err:
            raise _error(stmt, str(err)) from None
    return _translate_with_directives(stmt, source, directives, counter)


def _translate_with_directives(stmt, source, directives, counter) -> str:
    """An asm statement with one #if ... #endif group inside: each branch's statement translated,
    the directives kept around the translations."""
    texts, dirs, pos = [], [], stmt.start
    for start, end in directives:
        texts.append(source[pos:start])
        dirs.append(source[start:end].rstrip("\n"))
        pos = end
    texts.append(source[pos:stmt.end])
    kinds = [re.match(r"#\s*(\w+)", d).group(1) for d in dirs]
    if (kinds[0] not in ("if", "ifdef", "ifndef") or kinds[-1] != "endif"
            or any(k in ("if", "ifdef", "ifndef", "endif") for k in kinds[1:-1])):
        raise _error(stmt, "preprocessor directives inside it other than one #if ... #endif group")
    head, tail = texts[0], texts[-1]
    out = ["\n", dirs[0], "\n"]
    for k in range(1, len(dirs)):
        out.append(_branch(stmt, head + texts[k] + tail, counter) + "\n")  # the source's ';' ends it
        out.append(dirs[k] + "\n")
    return "".join(out)


def _branch(stmt, text, counter) -> str:
    sub = AsmStatement(text, 0, len(text), stmt.line, stmt.active, stmt.condition)
    _parse_statement(sub, text)
    try:
        return _translate_one(sub, counter)
    except _Unsupported as err:
        raise _error(sub, str(err)) from None


def translate(cuda_source: str, *, defines=None, undefined=()) -> str:
    """`cuda_source` with every known inline asm statement replaced by emulation calls (see the
    module docstring), line for line. The calls need ``rammer_emu_mma.h`` (``HEADER``), which the
    emulator's force-included ``rammer_emu.h`` includes after the runtime.

    ``defines`` ({macro: value}, default ``DEFAULT_DEFINES``) and ``undefined`` (macro names) are
    the macros the emulator's compilation is known to define / not define. Raises EmulatorError
    quoting the first asm statement whose PTX the emulator does not know."""
    if not isinstance(cuda_source, str):
        raise TypeError(f"translate() takes the CUDA source as a str, not {type(cuda_source).__name__}")
    statements = find_asm(cuda_source, defines, undefined)
    out, pos, counter = [], 0, [0]
    for stmt in statements:
        if stmt.active is False:
            continue
        out.append(cuda_source[pos:stmt.start])
        out.append(_translate_statement(stmt, cuda_source, counter))
        pos = stmt.end
    out.append(cuda_source[pos:])
    return "".join(out)
