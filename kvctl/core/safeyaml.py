"""YAML from files kvctl did not write: ``safe_load`` with limits on aliases, expansion and depth.

PyYAML's SafeLoader shares an aliased node, so a few-line "billion laughs" loads at once; the
blow-up comes later, when the mapping is compared, copied or dumped (10^9 nodes). Here the
composed node graph is checked first: at most ``YAML_MAX_ALIASES`` aliases, at most
``YAML_MAX_NODES`` nodes once every alias is expanded, no alias cycle; nesting too deep for
the parser is refused too. Every refusal is an InvalidInput naming the file and the line.
"""

from __future__ import annotations

from typing import Any

from kvctl.core.errors import InvalidInput
from kvctl.core.thresholds import YAML_MAX_ALIASES, YAML_MAX_NODES


def _where(e: Exception) -> str:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    return f"line {mark.line + 1}" if mark is not None else "unknown line"


def _check(node: Any, path: str, aliases: int) -> None:
    """Refuse ``node`` when its aliases expand past YAML_MAX_NODES nodes or form a cycle (memoised walk)."""
    import yaml  # noqa: PLC0415

    sizes: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[Any, bool]] = [(node, False)]
    while stack:  # iterative post-order: deep documents do not hit Python's recursion limit
        n, done = stack.pop()
        key = id(n)
        if done:
            active.discard(key)
            kids = [c for pair in n.value for c in pair] if isinstance(n, yaml.MappingNode) else n.value
            sizes[key] = 1 + sum(sizes[id(c)] for c in kids)
            if sizes[key] > YAML_MAX_NODES:
                raise InvalidInput(
                    f"{path}: the YAML expands to more than {YAML_MAX_NODES:,} nodes through its {aliases} alias(es) "
                    f"(near line {n.start_mark.line + 1}): refused as an alias bomb; the file was not changed"
                )
            continue
        if key in sizes:
            continue
        if key in active:
            raise InvalidInput(f"{path}: an alias on line {n.start_mark.line + 1} refers to itself (a cycle): refused; the file was not changed")
        if isinstance(n, yaml.ScalarNode):
            sizes[key] = 1
            continue
        active.add(key)
        stack.append((n, True))
        kids = [c for pair in n.value for c in pair] if isinstance(n, yaml.MappingNode) else n.value
        stack.extend((c, False) for c in kids if id(c) not in sizes)


def compose(text: str, path: str) -> Any:
    """The YAML node tree of ``text`` (None when empty), checked; InvalidInput with the line when malformed."""
    import yaml  # noqa: PLC0415

    class Loader(yaml.SafeLoader):
        aliases = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                Loader.aliases += 1
                if Loader.aliases > YAML_MAX_ALIASES:
                    mark = self.peek_event().start_mark
                    raise InvalidInput(f"{path}: more than {YAML_MAX_ALIASES} YAML aliases (line {mark.line + 1}): refused; the file was not changed")
            return super().compose_node(parent, index)

    loader = Loader(text)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise InvalidInput(f"{path}: malformed YAML at {_where(e)}: {problem}; the file was not changed") from e
    except RecursionError as e:
        raise InvalidInput(f"{path}: the YAML is nested too deeply to read: refused; the file was not changed") from e
    finally:
        loader.dispose()
    if node is not None:
        _check(node, path, Loader.aliases)
    return node


def load(text: str, path: str) -> Any:
    """``yaml.safe_load(text)`` within the limits; InvalidInput naming the line for malformed YAML or a tag
    such as ``!!python/object`` that safe loading refuses."""
    import yaml  # noqa: PLC0415

    node = compose(text, path)
    if node is None:
        return None
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise InvalidInput(f"{path}: {problem} at {_where(e)}; the file was not changed") from e
    except RecursionError as e:
        raise InvalidInput(f"{path}: the YAML is nested too deeply to read: refused; the file was not changed") from e
    finally:
        loader.dispose()
