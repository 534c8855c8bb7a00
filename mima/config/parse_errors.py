"""The config library's refusals, and a refusal of the classes a config names, as one line each.

jsonargparse words a refused value as an indented tree: `Parser key "K":`, then for a union of types
every subtype's error (`Errors:`), the given value, and for a class the config names
`Problem with given class_path 'C':` with that class's own errors nested below. `config_error_text`
reads the tree and says the most specific thing in it: a declared option's range (the same line a
config file's value gets, mima.config.options.check_value), else the option, what was given and what
is expected, or the message of the class or library that refused. `construction_refusal` is the line
of a class a config names that refused its arguments when it was made (a logger, a callback, a plugin):
the option, the class and the library's own message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import yaml

from mima.config.options import OPTIONS, check_value
from mima.core.errors import MimaError

MAX_LINE = 400  # a refusal of the config library, cut beyond this
MAX_LIBRARY_MESSAGE = 1000  # a library's own message (MLflow's names the fix at its end)
PARSER_KEY = re.compile(r'^Parser key "(?P<key>[^"]+)":\s*(?P<rest>.*)$')
CLASS_PROBLEM = re.compile(r"^Problem with given class_path '(?P<class_path>[^']+)':\s*(?P<rest>.*)$")
EXPECTED = re.compile(r"^Expected an? (?P<type>.+?)(?:\. Got value: (?P<given>.*))?$")
TYPE_WORDS = {"int": ["an integer"], "float": ["a number"], "bool": ["true", "false"], "str": ["a string"],
              "NoneType": ["null"], "dict": ["a mapping"], "list": ["a list"]}


@dataclass
class Node:
    """One line of jsonargparse's message and the lines indented below it."""

    text: str
    children: list[Node] = field(default_factory=list)

    def flat(self) -> str:
        """This line and every line below it, on one line."""
        return " ".join([self.text, *(child.flat() for child in self.children)]).strip()


def message_tree(text: str) -> Node:
    """jsonargparse's message as a tree of its lines by indentation (a bullet's `- ` dropped)."""
    root, stack = Node(""), []
    for line in text.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        node = Node(re.sub(r"^- ", "", line.strip()))
        (stack[-1][1] if stack else root).children.append(node)
        stack.append((indent, node))
    return root


def config_error_text(exc: BaseException) -> str:
    """jsonargparse's refusal on one line: 'model.lr: 'inf' is not a finite number > 0 and <= 10',
    'model.quick_gelu: 'maybe' is not true, false or 'auto'', or the refusing class's own message."""
    root = message_tree(str(exc).strip())
    if not root.children:
        return type(exc).__name__
    text = block_text(root.children, "")
    return text if len(text) <= MAX_LINE else text[:MAX_LINE] + " ..."


def block_text(nodes: list[Node], key: str) -> str:
    """What one block of the tree says, `key` the option it is about ("" at the top)."""
    first = nodes[0]
    keyed = PARSER_KEY.match(first.text)
    if keyed is not None:
        inner = ([Node(keyed["rest"])] if keyed["rest"] else []) + first.children
        full_key = f"{key}.{keyed['key']}" if key else keyed["key"]
        declared = declared_refusal(full_key, inner) if not key else None
        return declared or (block_text(inner, full_key) if inner else full_key)
    problem = CLASS_PROBLEM.match(first.text)
    if problem is not None:
        inner = ([Node(problem["rest"])] if problem["rest"] else []) + first.children
        return f"{prefix(key)}{problem['class_path']}: {block_text(inner, '') if inner else 'refused'}"
    errors = next((node for node in nodes if node.text == "Errors:"), None)
    if errors is not None:
        return union_text(nodes, errors, key)
    expected = EXPECTED.match(first.text)
    if expected is not None:
        given = expected["given"] if expected["given"] is not None else given_value(nodes)
        return f"{prefix(key)}{shown(given, None)} is not {alternatives(type_words(expected['type']))}"
    return prefix(key) + " ".join(node.flat() for node in nodes)


def union_text(nodes: list[Node], errors: Node, key: str) -> str:
    """A value no type of a union took: the first error that is more than a type mismatch (a class's
    own refusal), else what was given and the types expected."""
    specific = [item for item in errors.children if not EXPECTED.match(item.text)]
    if specific:
        return block_text([specific[0]], key)
    subtypes = next((node.text for node in nodes if node.text.startswith("Subtypes:")), "Subtypes: []")
    words = [word for subtype in split_top_level(subtypes.partition(":")[2].strip()[1:-1])
             for word in type_words(subtype)]
    return f"{prefix(key)}{shown(given_value(nodes), given_type(nodes))} is not {alternatives(words)}"


def prefix(key: str) -> str:
    return f"{key}: " if key else ""


def given_value(nodes: list[Node]) -> str | None:
    """The `Given value:` (or `Got value:`) of a block, as jsonargparse printed it."""
    for node in nodes:
        if node.text.startswith("Given value:"):
            return node.text.partition(":")[2].strip()
        expected = EXPECTED.match(node.text)
        if expected is not None and expected["given"] is not None:
            return expected["given"]
    return None


def given_type(nodes: list[Node]) -> str | None:
    """The `Given value type:` of a block (`<class 'str'>`), where jsonargparse printed one."""
    return next((node.text.partition(":")[2].strip() for node in nodes if node.text.startswith("Given value type:")), None)


def declared_refusal(key: str, nodes: list[Node]) -> str | None:
    """The line mima's own check gives `key`'s value (the block `nodes` refuses) where the option
    declares a range (what a config file's value gets), or None."""
    facts, given = OPTIONS.get(key), given_value(nodes)
    if given is None or facts is None or (facts.bounds is None and facts.entries is None):
        return None
    value = given_object(given, given_type(nodes))
    if isinstance(value, list | dict):  # the range is a number's: say the type instead (union_text)
        return None
    try:
        check_value(key, value)
    except MimaError as exc:
        return str(exc)
    return None


def given_object(given: str, given_type: str | None) -> object:
    """The given value as jsonargparse printed it, read back: a list or mapping (or, where the type
    printed says so, a number) as such; else the string (a command line's values are strings)."""
    readable = given.startswith(("[", "{")) or given_type not in (None, "<class 'str'>")
    if readable and len(given) <= 200 and not given.startswith(("Namespace(", "NestedArg(")):
        try:
            return yaml.safe_load(given)
        except yaml.YAMLError:
            pass
    return given


def shown(given: str | None, given_type: str | None) -> str:
    """The given value as a config would spell it, long values cut."""
    if given is None or given.startswith(("Namespace(", "NestedArg(")):
        return "the value given"
    text = repr(given_object(given, given_type))
    return text if len(text) <= 40 else f"{text[:37]}..."


def split_top_level(text: str) -> list[str]:
    """`a, b[c, d], e` -> ['a', 'b[c, d]', 'e']: the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:index].strip())
            start = index + 1
    tail = text[start:].strip()
    return parts + ([tail] if tail else [])


def type_words(typehint: str) -> list[str]:
    """How a type printed by jsonargparse reads in an error line: `<class 'int'>` an integer,
    `typing.Literal['auto']` 'auto', a class `a.b.Logger` a Logger (class_path)."""
    typehint = typehint.strip()
    plain = re.fullmatch(r"<class '(?P<name>[\w.]+)'>", typehint)
    name = plain["name"] if plain else typehint
    literal = re.fullmatch(r"(?:typing\.)?Literal\[(?P<values>.*)\]", name)
    if literal is not None:
        return split_top_level(literal["values"])
    base = name.split("[", 1)[0].rsplit(".", 1)[-1]
    if base in TYPE_WORDS:
        return TYPE_WORDS[base]
    if base in ("Iterable", "Sequence", "List", "tuple", "Tuple"):
        return ["a list"]
    if base in ("Mapping", "Dict"):
        return ["a mapping"]
    return [f"a {base} (class_path)"] if "." in name else [name]


def alternatives(words: list[str]) -> str:
    """`a`, `a or b`, `a, b or c` (each once)."""
    unique = list(dict.fromkeys(words)) or ["of the expected type"]
    return unique[0] if len(unique) == 1 else f"{', '.join(unique[:-1])} or {unique[-1]}"


def library_message(exc: BaseException) -> str:
    """An exception's own message on one line (its type where it has none)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= MAX_LIBRARY_MESSAGE else text[:MAX_LIBRARY_MESSAGE] + " ..."


def construction_refusal(option: str, class_path: str, exc: BaseException) -> MimaError:
    """The one line of a class the config names (at `option`) that refused to be made with its
    arguments: the option, the class and the library's own message."""
    return MimaError(f"{option}: {class_path} could not be made: {type(exc).__name__}: {library_message(exc)}")
