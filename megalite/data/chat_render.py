"""The Jinja environment chat templates render in, and the bounds that make any template end in one line.

A chat template is code from a tokenizer's `tokenizer_config.json`, often a stranger's. It runs in Jinja's
immutable sandbox (no attribute starting with `_`, no mutation of lists and dicts: the attempts to reach
Python through a template end in a SecurityError) with what transformers' `apply_chat_template` offers
(`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, `tojson`, `strftime_now`) and two bounds
that end a render with `RenderLimit`, one line, instead of a hang or a MemoryError:

* **time**: `RenderBudget.tick` counts a step and checks a deadline, and every way a template can repeat work
  passes it: each iteration of every `{% for %}` (the loops' iterables are wrapped when the template is
  compiled), each call (macros, recursive loops, methods), each filter and test (also those `map`/`select`
  apply per item), each attribute or item lookup, each intercepted operator, each chunk of output. Jinja has
  no other loop (no while, no unbounded range: the sandbox's range stops at 100,000), so the only work between
  two ticks is one built-in operation (a sort, an `in` scan, a join) on values the size bound keeps small:
  at most seconds, after which the next tick sees the deadline;
* **size**: the output is counted chunk by chunk (`Template.generate`); every value an operator, filter or
  call makes, every argument a call or filter gets, and every value a lookup returns, is measured
  (`deep_size`: characters plus items, containers followed) and refused past `max_chars`; an operation that
  can multiply its input (`*` by an int, `**`, a width or count argument, `%`/`format`, `replace`, `join`,
  `indent`, `expandtabs`) is refused before it runs when a bound of its result is past the limit. So no value
  grows past the limit by more than one additive step (a `+`, a `~`, a captured `{% set %}` block: a few times
  the limit), and a MemoryError that still happens (an allocation the machine cannot give) is caught and
  reported the same way.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from megalite.errors import DataError

START, END = "\ue000", "\ue001"  # private-use characters around each generation block's output
MAX_CHARS = 1 << 26      # 64 Mi characters: four times the default data.max_record_bytes, far above any chat
MAX_INT_BITS = 1 << 14   # integers a template computes (an index, a count) are small
RENDER_SECONDS = 10.0    # a render is milliseconds; ten seconds is a template that does not end
MAX_STEPS = 5_000_000    # loop iterations, calls, lookups: a long chat renders in thousands; this is seconds
MAX_PARTS = 4_000_000    # strings and containers one value holds (a list of strings is one part)
_LOOP_FILTER = "megalite_bounded_loop"  # wraps each {% for %}'s iterable (not a name a template can mean)
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class Bounds:
    """How far one render may go (the defaults above; tests lower them to stay fast)."""

    seconds: float = RENDER_SECONDS
    max_chars: int = MAX_CHARS
    max_steps: int = MAX_STEPS


class RenderLimit(DataError):
    """A template ran past the time or size bound (exit 3: the template is the data's)."""


class RenderBudget:
    """This thread's current render: its step count, deadline and size limit (`tick`/`check` raise RenderLimit).
    The step count makes the bound the same on any machine; the deadline also covers slow single steps."""

    def __init__(self, seconds: float, max_chars: int, max_steps: int = MAX_STEPS) -> None:
        self.seconds, self.max_chars, self.max_steps = seconds, max_chars, max_steps
        self.deadline = time.monotonic() + seconds
        self.steps = 0

    def tick(self) -> None:
        self.steps += 1
        if self.steps > self.max_steps:
            raise RenderLimit(f"the chat template takes more than {self.max_steps:,} steps (loop iterations, calls, "
                              "lookups) on one conversation (a loop that does not end?): fix the template or pass "
                              "another with --data.chat_template FILE")
        if self.steps % 64 == 0 and time.monotonic() > self.deadline:  # a step is microseconds: 64 are nothing
            raise RenderLimit(f"the chat template ran longer than {self.seconds:g} s on one conversation (a loop "
                              "that does not end?): fix the template or pass another with --data.chat_template FILE")

    def check(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise RenderLimit(f"the chat template makes {what} over {self.max_chars:,} characters on one "
                              "conversation: fix the template or pass another with --data.chat_template FILE")


def deep_size(value: Any, limit: int) -> int:
    """Characters of strings plus items of containers, following containers; stops counting past `limit`, and
    calls a value of more than MAX_PARTS containers and strings too large (shared parts are counted each time
    they are reached, so a small list nested in itself 40 times is as large as the 2**40 it stands for)."""
    total, stack, parts = 0, [value], 0
    while stack and total <= limit:
        parts += 1
        if parts > MAX_PARTS:
            return limit + 1
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v)
        elif isinstance(v, int) and not isinstance(v, bool):
            total += v.bit_length() // 64 + 1
        elif isinstance(v, dict):
            total += len(v)
            if total <= limit:
                stack.extend(v.keys())
                stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += len(v)
            if total > limit:
                break
            if set(map(type, v)) <= {str}:  # a list of strings (a split): measured at C speed
                total += sum(map(len, v))
            else:
                stack.extend(v)
        else:
            total += 1
    return total


def _ints(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int]:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]


def _format_bound(fmt: str, args: Any, limit: int) -> int:
    """A bound of `fmt % args` / `fmt.format(*args)`: each field at most the largest argument padded to the
    largest width written in the format."""
    fields = fmt.count("%") + fmt.count("{")
    widths = [int(d) if len(d) < 12 else limit + 1 for d in _DIGITS.findall(fmt)]
    return len(fmt) + fields * (deep_size(args, limit) + max(widths, default=0))


def growth_bound(name: str, subject: Any, args: tuple[Any, ...], kwargs: dict[str, Any], limit: int) -> int:
    """A bound of the size of `subject.name(*args)` (or the filter `name`) for the operations that multiply
    their input; 0 for the others (they are measured after they run)."""
    for n in _ints(args, kwargs):
        if abs(n) > limit:
            return abs(n)
    if not isinstance(subject, str):
        return 0
    text = [a for a in (*args, *kwargs.values()) if isinstance(a, str)]
    widest = max((len(t) for t in text), default=0)
    ints = _ints(args, kwargs)
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str):
        count = subject.count(args[0]) if args[0] else len(subject) + 1
        return len(subject) + count * deep_size(args[1], limit)
    if name == "expandtabs":
        return len(subject) + subject.count("\t") * max(ints, default=8)
    if name == "indent":  # each line gets the indent (a width or a string)
        return len(subject) + (subject.count("\n") + 1) * max(max(ints, default=4), widest)
    if name == "wordwrap":  # a break string at most every character
        return len(subject) + (len(subject) + 1) * max(widest, 1)
    if name in ("format", "format_map"):
        return _format_bound(subject, (args, kwargs), limit)
    return 0


class Loop:
    """A `{% for %}`'s iterable, ticking the budget at each item."""

    def __init__(self, budget: Callable[[], RenderBudget], items: Any) -> None:
        self._budget, self._items = budget, items  # private: the sandbox hides them from a template

    def __iter__(self) -> Iterator[Any]:
        budget = self._budget()
        for item in self._items:
            budget.tick()
            yield item

    def __len__(self) -> int:  # `loop.length` and `|length` stay as cheap as on the plain iterable
        return len(self._items)


def environment(generation: type) -> Any:
    """The sandboxed environment with the bounds above; `generation` is the `{% generation %}` extension."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    local = threading.local()  # each thread's RenderBudget: a validation read may render beside the loader

    def budget() -> RenderBudget:
        current = getattr(local, "budget", None)
        if current is None:
            raise RuntimeError("a chat template rendered outside bounded_render")
        return current

    def measured(value: Any, what: str) -> Any:
        if value is None or isinstance(value, (bool, float)):
            return value
        b = budget()
        b.check(len(value) if type(value) is str else deep_size(value, b.max_chars), what)
        return value

    class Bounded(ImmutableSandboxedEnvironment):  # type: ignore[misc]
        intercepted_binops = frozenset({"*", "**", "%", "+"})  # those that can make a value larger

        def __init__(self, **options: Any) -> None:
            super().__init__(**options)
            self.render_budget = local

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            b = budget()
            b.tick()
            limit = b.max_chars
            if operator == "*" and isinstance(left, int) != isinstance(right, int):
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                b.check(deep_size(seq, limit) * max(0, int(n)), "a repeated value")
            if operator in ("*", "**") and all(isinstance(x, int) for x in (left, right)):
                bits = (left.bit_length() + right.bit_length() if operator == "*"
                        else left.bit_length() * max(0, right))
                if bits > MAX_INT_BITS:
                    raise RenderLimit(f"the chat template computes an integer over {MAX_INT_BITS} bits: fix the "
                                      "template or pass another with --data.chat_template FILE")
            if operator == "%" and isinstance(left, str):
                b.check(_format_bound(left, right, limit), "a formatted string")
            return measured(self.binop_table[operator](left, right), "a value")

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            b = budget()
            b.tick()
            # Arguments too: a macro's argument (`f(s ~ s)`) is a value no other hook saw being made.
            b.check(deep_size([args, kwargs], b.max_chars), "an argument")
            target = getattr(__obj, "__wrapped__", __obj)  # the sandbox's str.format wrapper
            subject = getattr(target, "__self__", None)
            name = getattr(target, "__name__", "")
            if isinstance(subject, str) and name == "join":
                items = list(args[0]) if args else []
                b.check(deep_size(items, b.max_chars) + len(subject) * len(items), "a joined string")
                args = (items, *args[1:])
            elif isinstance(subject, (str, list, tuple, dict)):
                b.check(growth_bound(name, subject, args, kwargs, b.max_chars), "a value")
            return measured(super().call(__context, __obj, *args, **kwargs), "a value")

        def getattr(self, obj: Any, attribute: str) -> Any:
            budget().tick()
            return measured(super().getattr(obj, attribute), "a value")

        def getitem(self, obj: Any, argument: Any) -> Any:
            budget().tick()
            return measured(super().getitem(obj, argument), "a value")

    def guard(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        """`f` (a filter or test) ticking the budget and bounded in size like a call."""

        @functools.wraps(f)  # keeps jinja's pass_context/pass_environment marks
        def guarded(*args: Any, **kwargs: Any) -> Any:
            b = budget()
            b.tick()
            values = [a for a in args if not isinstance(a, (Context, jinja2.Environment, EvalContext))]
            b.check(deep_size([values, kwargs], b.max_chars), "an argument")
            if name == "join" and values:
                items = list(values[0])
                sep = values[1] if len(values) > 1 else kwargs.get("d", "")
                b.check(deep_size(items, b.max_chars) + len(str(sep)) * len(items), "a joined string")
                args = tuple(items if a is values[0] else a for a in args)
            elif values:
                b.check(growth_bound(name, values[0], tuple(values[1:]), kwargs, b.max_chars), "a value")
                if name == "tojson":
                    b.check(deep_size(values[0], b.max_chars) * (1 + (_ints((), kwargs) or [0])[0]), "a value")
            return measured(f(*args, **kwargs), "a value")

        return guarded

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.pop("lipsum", None)  # n paragraphs of filler: no chat template's business, and unbounded
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters = {name: guard(name, f) for name, f in env.filters.items()}
    tests: dict[str, Any] = env.tests  # typed by jinja as the bare `function`
    env.tests = {name: guard(name, f) for name, f in tests.items()}
    env.filters[_LOOP_FILTER] = lambda items: Loop(budget, items)
    return env


def compile_bounded(env: Any, text: str) -> Any:
    """`text` compiled with every `{% for %}` iterating through `Loop` (a tick per item)."""
    from jinja2 import nodes

    tree = env.parse(text)
    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Filter(loop.iter, _LOOP_FILTER, [], [], None, None, lineno=loop.lineno)
    return env.from_string(tree)


def bounded_render(env: Any, template: Any, variables: dict[str, Any], bounds: Bounds) -> str:
    """`template` rendered with `variables` within the bounds (RenderLimit past them)."""
    local = env.render_budget
    budget = RenderBudget(bounds.seconds, bounds.max_chars, bounds.max_steps)
    local.budget = budget
    out: list[str] = []
    size = 0
    try:
        for chunk in template.generate(**variables):
            budget.tick()
            size += len(chunk)
            budget.check(size, "output")
            out.append(chunk)
    except MemoryError as e:
        raise RenderLimit("the chat template makes a value larger than memory on one conversation: fix the "
                          "template or pass another with --data.chat_template FILE") from e
    except RecursionError as e:
        raise RenderLimit("the chat template recurses without end on one conversation: fix the template or "
                          "pass another with --data.chat_template FILE") from e
    finally:
        local.budget = None
    return "".join(out)
