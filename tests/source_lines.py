"""The code lines of a function, for tests that pin a swapped forward to timm's source (a timm
release that changes the stock forward fails them, so the Mesa copy is updated with it)."""
import inspect


def code_lines(fn) -> list:
    """Code lines of ``fn`` without its signature, docstring, comments and blank lines, stripped."""
    lines = [ln.split("#")[0].rstrip() for ln in inspect.getsource(fn).splitlines()]
    start = next(i for i, ln in enumerate(lines) if ln.endswith(":")) + 1  # after the signature
    body, in_doc = [], False
    for ln in lines[start:]:
        s = ln.strip()
        if s.startswith('"""'):
            in_doc = not (in_doc or (s.count('"""') == 2))
            continue
        if in_doc or not s:
            continue
        body.append(s)
    return body
