"""Fails when a production source outside a backend's folder spells that backend's name.

A backend declares its name once, in its descriptor (src/backends/<name>/descriptor.cc);
src/backends/registry.cc lists the descriptors. Everything else finds a backend through
the registry, so this test reads every C++ and Python source under src/, tools/, include/
and python/wsync/ (tests, fuzz harnesses and test helpers excluded) and lists each string
literal that is exactly a backend's name, outside src/backends/<that name>/ and the
registry. Comments and docstrings are prose and are not read.

Usage: backend_names_test.py SOURCE_DIR
"""

import ast
import io
import os
import re
import sys
import tokenize

ROOTS = ("src", "tools", "include", "python/wsync")
REGISTRY = "src/backends/registry.cc"
# Literals equal to a backend's name that mean something else, by file: (path, literal, why).
NOT_A_BACKEND = {
    ("src/comm/nccl_communicator.cc", "nccl"): "the NCCL library's communicator kind",
    ("include/wsync/backend.h", "nccl"): "kDefaultBackend, the options structs' default "
                                         "(backend_registry_test checks it is registered)",
}


def backend_names(root):
    names = set()
    base = os.path.join(root, "src", "backends")
    for entry in sorted(os.listdir(base)):
        descriptor = os.path.join(base, entry, "descriptor.cc")
        if not os.path.isfile(descriptor):
            continue
        m = re.search(r'\.name\s*=\s*"([^"]+)"', open(descriptor, encoding="utf-8").read())
        if not m or m.group(1) != entry:
            sys.exit(f"{descriptor}: expected .name = \"{entry}\" (a backend's folder is its name)")
        names.add(entry)
    return names


def is_test_file(rel):
    name = os.path.basename(rel)
    return (re.search(r"_(test|fuzz)\.(cc|h|py)$", name) is not None or name in ("testing.h", "conftest.py")
            or name.startswith("test_") or "/testing/" in f"/{rel}" or rel.startswith("src/testing/"))


def cpp_literals(text):
    """(line, value) of every ordinary string literal in C++ source, comments skipped."""
    out, i, n, line = [], 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            line += text.count("\n", i, j)
            i = j
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            open_paren = text.find("(", i + 2)
            delim = text[i + 2:open_paren]
            j = text.find(")" + delim + '"', open_paren)
            j = n if j < 0 else j + len(delim) + 2
            out.append((line, text[open_paren + 1:j - len(delim) - 2]))
            line += text.count("\n", i, j)
            i = j
        elif c in "\"'":
            j, value = i + 1, []
            while j < n and text[j] != c and text[j] != "\n":
                if text[j] == "\\":
                    value.append(text[j:j + 2])
                    j += 2
                else:
                    value.append(text[j])
                    j += 1
            if c == '"':
                out.append((line, "".join(value)))
            i = j + 1
        else:
            i += 1
    return out


def python_literals(text):
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type != tokenize.STRING:
            continue
        try:
            value = ast.literal_eval(tok.string)
        except (ValueError, SyntaxError):
            continue  # an f-string: not a plain name
        if isinstance(value, str):
            out.append((tok.start[0], value))
    return out


def main(root):
    names = backend_names(root)
    if not names:
        sys.exit("no backend descriptors found under src/backends/*/descriptor.cc")
    problems = []
    for top in ROOTS:
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)
                if not f.endswith((".cc", ".h", ".py")) or is_test_file(rel) or rel == REGISTRY:
                    continue
                text = open(path, encoding="utf-8").read()
                literals = python_literals(text) if f.endswith(".py") else cpp_literals(text)
                for line, value in literals:
                    if value not in names or rel.startswith(f"src/backends/{value}/"):
                        continue
                    if (rel, value) in NOT_A_BACKEND:
                        continue
                    problems.append(f"{rel}:{line}: \"{value}\"")
    if problems:
        print("backend names outside their folder and src/backends/registry.cc (read them from the "
              "registry: src/backends/descriptor.h, or wsync._wsync.backends() in Python):")
        print("\n".join(problems))
        return 1
    print(f"ok: {', '.join(sorted(names))} appear only in their folders and the registry")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
