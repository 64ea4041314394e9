"""A chat template is a stranger's code: whatever it does, rendering ends in one line (a DataError, exit 3):
loops that do not end, values that grow past any memory, recursion, and the classic ways out of Jinja's
sandbox (which stay shut). Every template here is run on the probe conversations, as `build_chat` does when a
run starts; `max_chars` is lowered so that the growing ones stop after a MiB (the rule is the same)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megalite.data.chat_render import Bounds, RenderLimit
from megalite.data.chat_template import PROBES, ChatTemplate
from megalite.errors import DataError

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
GROW = [
    ("{{ 'x' * (16 * 1024 ** 3) }}", "over"),                                       # 16 GiB at once
    ("{{ [messages] * (1024 ** 3) }}", "over"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "over"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "over"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set t %}{{ ns.s }}{{ ns.s }}{% endset %}"
     "{% set ns.s = t %}{% endfor %}", "over"),
    ("{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s }}{% endif %}{% endmacro %}{{ d('x', 40) }}",
     "over"),
    ("{% macro d(s, n) %}{% if n %}{{ d([s, s], n - 1) }}{% endif %}{% endmacro %}{{ d('x', 40) }}", "over"),
    ("{{ 'x'|center(2 ** 34) }}", "over"),
    ("{{ 'x'.ljust(2 ** 34) }}", "over"),
    ("{{ 'x'|indent('y' * 60000) * 1 }}{{ ('\n' * 60000)|indent('y' * 60000) }}", "over"),
    ("{{ ('x' * 60000).replace('x', 'y' * 60000) }}", "over"),
    ("{{ ('y' * 60000).join(['a'] * 60000) }}", "over"),
    ("{{ (['a'] * 60000)|join('y' * 60000) }}", "over"),
    ("{{ '%0999999999999d' % 1 }}", "over"),
    ("{{ '{:>99999999999}'.format(1) }}", "over"),
    ("{{ 10 ** (10 ** 8) }}", "bits"),
    ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}", "bits"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}", "over|steps"),
]
HANG = [
    LOOP,
    "{% macro f(n) %}{% for i in range(100000) %}{{ f(n) }}{% endfor %}{% endmacro %}{{ f(0) }}",
    "{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% endfor %}",
    "{{ range(100000)|select('in', range(100000)|list)|list|length }}",
    "{{ range(100000)|map('string')|map('center', 9)|select('in', range(100000)|map('string')|list)|list }}",
    "{% set t %}{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}{% endset %}",
    "{% for i in range(100000) recursive %}{{ loop(range(100000)) }}{% endfor %}",
]
ESCAPES = [
    "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.popen('touch {marker}').read() }}",
    "{{ lipsum.__globals__['os'].popen('touch {marker}').read() }}",
    "{{ raise_exception.__globals__['__builtins__']['open']('{marker}', 'w') }}",
    "{{ '{0.__class__.__base__.__subclasses__}'.format('') }}",
    "{% set x = messages.append(1) %}{{ messages.pop() }}{{ namespace.__init__.__globals__ }}",
]


def _run(text: str, bounds: Bounds = Bounds()) -> None:
    template = ChatTemplate(text, {"eos_token": "<|endoftext|>"}, bounds)
    for probe in PROBES:
        template.render(probe)


@pytest.mark.parametrize("text,match", GROW)
def test_a_template_growing_a_value_stops_in_one_line(text: str, match: str) -> None:
    with pytest.raises(RenderLimit, match=match) as e:
        _run(text, Bounds(max_chars=1 << 20))
    assert "\n" not in str(e.value) and "--data.chat_template" in str(e.value)


@pytest.mark.parametrize("text", HANG)
def test_a_template_that_does_not_end_stops_in_one_line(text: str) -> None:
    # Lowered bounds, the same rule: a step bound of 100,000 (loop items, calls, lookups) ends the loops, a
    # deadline of one second the `in` tests (each a C scan of 100,000 items, 10**10 compares in all).
    with pytest.raises(RenderLimit, match="steps|recurses|longer than") as e:
        _run(text, Bounds(seconds=1.0, max_steps=100_000))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text", ESCAPES)
def test_the_sandbox_stays_shut(tmp_path: Path, text: str) -> None:
    marker = tmp_path / "ran"
    with pytest.raises((DataError, ValueError)):
        _run(text.replace("{marker}", str(marker)))
    assert not marker.exists()


def test_the_bounds_leave_ordinary_templates_alone() -> None:
    # Loops, filters, methods and formatting a real template uses, on a conversation, well within the bounds.
    text = ("{% for m in messages %}{{ '%s: %s' % (m.role, m.content|trim) }}{{ '{}'.format(loop.index) }}"
            "{{ m.content.replace('a', 'b').split(' ')|join('-') }}{{ (m.content * 3)|center(80)|indent(2) }}"
            "{{ messages[:1]|length }}{{ m|tojson }}{{ 'ok' ~ eos_token }}{% endfor %}")
    long = [{"role": "user", "content": "a b " * 50_000}, {"role": "assistant", "content": "c"}]
    text_out, _ = ChatTemplate(text, {"eos_token": "<|endoftext|>"}).render(long)
    assert text_out.endswith("ok<|endoftext|>") and len(text_out) > 400_000
