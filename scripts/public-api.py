#!/usr/bin/env python3
"""The public API of a crate as a sorted text listing, from rustdoc's JSON.

    public-api.py target/doc/pgelect.json > api/pgelect.txt

Called by scripts/public-api.sh, which says why (cargo-public-api needs a
nightly toolchain). Standard library only.

One line per public item *per path it can be named by*: an item re-exported
at the crate root and also public in its module is listed twice, and so are
its methods, fields, variants and trait implementations. Lines carry the
item's kind and its signature, with types named by a public path of this
crate (the shortest) or the defining path of another crate's item; rustdoc's
numeric ids, spans and doc texts never appear, so a listing changes only
when the API does. Constants show their type, not their value.

Listed for each type: inherent methods, associated constants and types,
fields, variants, trait implementations written in this crate (derived
ones included, but not the compiler's StructuralPartialEq) and the auto
traits Send, Sync, Unpin, UnwindSafe and RefUnwindSafe, negative ones
included. Blanket implementations (From<T> for T, ...) are left out.
"""

import json
import sys

TESTED_FORMAT = 57
AUTO_TRAITS = {"Send", "Sync", "Unpin", "UnwindSafe", "RefUnwindSafe"}
# Implemented by derive(PartialEq) for the compiler's own use; not API.
HIDDEN_TRAITS = {"StructuralPartialEq"}


class Api:
    def __init__(self, doc):
        self.index = doc["index"]
        self.paths = doc["paths"]
        self.root = str(doc["root"])
        self.crate = self.index[self.root]["name"]
        self.public_paths = {}  # item id -> every public path (tuples)
        self.lines = {}  # line -> sort key: (path, group, member, line)
        self.members_seen = set()  # ids of methods, fields, variants

    def item(self, i):
        return self.index.get(str(i))

    # -- finding every public path ------------------------------------------

    def walk(self, module_id, prefix, seen=()):
        if module_id in seen:
            return
        module = self.item(module_id)
        for child in module["inner"]["module"]["items"]:
            it = self.item(child)
            if it is None or it["visibility"] != "public":
                continue
            kind, inner = next(iter(it["inner"].items()))
            if kind == "use":
                self.walk_use(inner, prefix, seen + (module_id,))
            else:
                self.add_path(str(child), prefix + (it["name"],))
                if kind == "module":
                    self.walk(str(child), prefix + (it["name"],), seen + (module_id,))

    def walk_use(self, use, prefix, seen):
        target = str(use["id"]) if use["id"] is not None else None
        it = self.item(target) if target else None
        if use["is_glob"]:
            if it is not None and "module" in it["inner"]:
                self.walk(target, prefix, seen)
            else:
                self.line(prefix, f"pub use {'::'.join(prefix)}::* // from {use['source']}")
            return
        path = prefix + (use["name"],)
        if it is None:
            # Another crate's item: what it is lives in that crate's docs.
            self.line(path, f"pub use {'::'.join(path)} = {self.extern_path(target, use['source'])}")
            return
        self.add_path(target, path)
        if "module" in it["inner"]:
            self.walk(target, path, seen)

    def line(self, path, text, group=0, member=""):
        """Sorted by the item's path, then the item before its members
        (by name) before its trait implementations."""
        self.lines[text] = ("::".join(path), group, member, text)

    def add_path(self, i, path):
        self.public_paths.setdefault(i, set()).add(path)

    def extern_path(self, i, written):
        p = self.paths.get(str(i)) if i is not None else None
        return "::".join(p["path"]) if p else written

    def name_of(self, i, written):
        """How a type is named in a signature."""
        found = self.public_paths.get(str(i))
        if found:
            return "::".join(min(found, key=lambda p: (len(p), p)))
        return self.extern_path(i, written)

    # -- rendering ----------------------------------------------------------

    def ty(self, t):
        if t is None:
            return "()"
        if isinstance(t, str):
            return t
        kind, v = next(iter(t.items()))
        if kind == "resolved_path":
            return self.path(v)
        if kind in ("generic", "primitive"):
            return v
        if kind == "borrowed_ref":
            life = f"{v['lifetime']} " if v["lifetime"] else ""
            return f"&{life}{'mut ' if v['is_mutable'] else ''}{self.ty(v['type'])}"
        if kind == "raw_pointer":
            return f"*{'mut' if v['is_mutable'] else 'const'} {self.ty(v['type'])}"
        if kind == "tuple":
            inner = ", ".join(self.ty(x) for x in v)
            return f"({inner},)" if len(v) == 1 else f"({inner})"
        if kind == "slice":
            return f"[{self.ty(v)}]"
        if kind == "array":
            return f"[{self.ty(v['type'])}; {v['len']}]"
        if kind == "impl_trait":
            return "impl " + self.bounds(v)
        if kind == "dyn_trait":
            parts = [self.poly_trait(p) for p in v["traits"]]
            if v.get("lifetime"):
                parts.append(v["lifetime"])
            return "dyn " + " + ".join(parts)
        if kind == "qualified_path":
            base = self.ty(v["self_type"])
            if v.get("trait"):
                base = f"<{base} as {self.path(v['trait'])}>"
            return f"{base}::{v['name']}{self.args(v.get('args'))}"
        if kind == "function_pointer":
            sig = v["sig"]
            inputs = ", ".join(self.ty(x[1]) for x in sig["inputs"])
            out = f" -> {self.ty(sig['output'])}" if sig["output"] else ""
            return f"fn({inputs}){out}"
        if kind == "infer":
            return "_"
        raise SystemExit(f"public-api.py: a type of kind {kind!r} is not rendered yet: {t}")

    def path(self, p):
        return self.name_of(p["id"], p["path"]) + self.args(p.get("args"))

    def args(self, a):
        if not a:
            return ""
        if "angle_bracketed" in a:
            ab = a["angle_bracketed"]
            out = []
            for x in ab["args"]:
                if x == "infer":
                    out.append("_")
                elif "type" in x:
                    out.append(self.ty(x["type"]))
                elif "lifetime" in x:
                    out.append(x["lifetime"])
                elif "const" in x:
                    out.append(x["const"].get("expr", "_"))
            for c in ab.get("constraints", []):
                b = c["binding"]
                if "equality" in b:
                    eq = b["equality"]
                    val = self.ty(eq["type"]) if "type" in eq else eq["constant"].get("expr", "_")
                    out.append(f"{c['name']} = {val}")
                else:
                    out.append(f"{c['name']}: {self.bounds(b['constraint'])}")
            return f"<{', '.join(out)}>" if out else ""
        if "parenthesized" in a:
            pa = a["parenthesized"]
            out = f" -> {self.ty(pa['output'])}" if pa.get("output") else ""
            return f"({', '.join(self.ty(x) for x in pa['inputs'])}){out}"
        return ""

    def poly_trait(self, p):
        hr = self.hrtb(p.get("generic_params"))
        return hr + self.path(p["trait"])

    def hrtb(self, params):
        names = [g["name"] for g in params or []]
        return f"for<{', '.join(names)}> " if names else ""

    def bounds(self, bs):
        out = []
        for b in bs:
            if "trait_bound" in b:
                tb = b["trait_bound"]
                mod = {"maybe": "?", "maybe_const": "~const "}.get(tb.get("modifier"), "")
                out.append(mod + self.hrtb(tb.get("generic_params")) + self.path(tb["trait"]))
            elif "outlives" in b:
                out.append(b["outlives"])
            elif "use" in b:
                out.append("use<" + ", ".join(str(x) for x in b["use"]) + ">")
        return " + ".join(out)

    def generics(self, g):
        params = []
        for p in g["params"]:
            kind, v = next(iter(p["kind"].items()))
            if kind == "lifetime":
                params.append(p["name"] + (": " + " + ".join(v["outlives"]) if v["outlives"] else ""))
            elif kind == "type":
                if v.get("is_synthetic"):
                    continue  # `impl Trait` in argument position
                s = p["name"] + (": " + self.bounds(v["bounds"]) if v["bounds"] else "")
                if v.get("default"):
                    s += " = " + self.ty(v["default"])
                params.append(s)
            elif kind == "const":
                params.append(f"const {p['name']}: {self.ty(v['type'])}")
        where = []
        for w in g["where_predicates"]:
            kind, v = next(iter(w.items()))
            if kind == "bound_predicate":
                where.append(self.hrtb(v.get("generic_params")) + f"{self.ty(v['type'])}: {self.bounds(v['bounds'])}")
            elif kind == "lifetime_predicate":
                where.append(f"{v['lifetime']}: {' + '.join(v['outlives'])}")
            elif kind == "eq_predicate":
                rhs = v["rhs"]
                where.append(f"{self.ty(v['lhs'])} = {self.ty(rhs['type']) if 'type' in rhs else '_'}")
        return (f"<{', '.join(params)}>" if params else ""), (" where " + ", ".join(where) if where else "")

    def fn(self, name, f):
        h = f["header"]
        quals = "".join(q for q, on in (("const ", h["is_const"]), ("async ", h["is_async"]),
                                          ("unsafe ", h["is_unsafe"])) if on)
        params, where = self.generics(f["generics"])
        inputs = []
        for arg, t in f["sig"]["inputs"]:
            if arg == "self":
                t = self.ty(t)
                inputs.append({"Self": "self", "&Self": "&self", "&mut Self": "&mut self"}.get(t, f"self: {t}"))
            else:
                inputs.append(f"{arg}: {self.ty(t)}")
        out = f" -> {self.ty(f['sig']['output'])}" if f["sig"]["output"] is not None else ""
        return f"pub {quals}fn {name}{params}({', '.join(inputs)}){out}{where}"

    @staticmethod
    def marks(it):
        m = []
        for a in it.get("attrs", []):
            if a == "non_exhaustive" or (isinstance(a, dict) and "non_exhaustive" in a):
                m.append("#[non_exhaustive] ")
            elif isinstance(a, dict) and "must_use" in a:
                m.append("#[must_use] ")
        return "".join(sorted(set(m)))

    # -- one line per item and path -----------------------------------------

    def emit(self, i, path):
        it = self.item(i)
        kind, v = next(iter(it["inner"].items()))
        name = "::".join(path)
        mark = self.marks(it)
        if kind == "module":
            self.line(path, f"pub mod {name}")
        elif kind == "function":
            self.line(path, mark + self.fn(name, v))
        elif kind == "constant":
            self.line(path, f"pub const {name}: {self.ty(v['type'])}")
        elif kind == "static":
            self.line(path, f"pub static {'mut ' if v.get('is_mutable') else ''}{name}: {self.ty(v['type'])}")
        elif kind == "type_alias":
            params, where = self.generics(v["generics"])
            self.line(path, f"pub type {name}{params} = {self.ty(v['type'])}{where}")
        elif kind == "struct":
            params, where = self.generics(v["generics"])
            sk, sv = next(iter(v["kind"].items())) if isinstance(v["kind"], dict) else (v["kind"], None)
            if sk == "tuple":
                fields = ", ".join(f"pub {self.ty(self.item(f)['inner']['struct_field'])}"
                                   if f is not None else "_" for f in sv)
                self.line(path, f"{mark}pub struct {name}{params}({fields}){where}")
            else:
                self.line(path, f"{mark}pub struct {name}{params}{where}")
                for f in (sv or {}).get("fields", []):
                    self.field(f, path)
            self.members(v["impls"], path)
        elif kind == "union":
            params, where = self.generics(v["generics"])
            self.line(path, f"{mark}pub union {name}{params}{where}")
            for f in v["fields"]:
                self.field(f, path)
            self.members(v["impls"], path)
        elif kind == "enum":
            params, where = self.generics(v["generics"])
            self.line(path, f"{mark}pub enum {name}{params}{where}")
            for var in v["variants"]:
                self.variant(var, path)
            self.members(v["impls"], path)
        elif kind == "trait":
            params, where = self.generics(v["generics"])
            sup = ": " + self.bounds(v["bounds"]) if v["bounds"] else ""
            self.line(path, f"pub {'unsafe ' if v['is_unsafe'] else ''}trait {name}{params}{sup}{where}")
            for m in v["items"]:
                self.assoc(m, path, in_trait=True)
        elif kind == "macro" or kind == "proc_macro":
            self.line(path, f"pub macro {name}!")
        else:
            raise SystemExit(f"public-api.py: an item of kind {kind!r} is not rendered yet: {name}")

    def field(self, f, owner):
        it = self.item(f)
        if it is None or it["visibility"] != "public":
            return
        self.members_seen.add(f)
        name = "::".join(owner + (it["name"],))
        self.line(owner, f"pub {name}: {self.ty(it['inner']['struct_field'])}", 1, it["name"])

    def variant(self, i, owner):
        it = self.item(i)
        self.members_seen.add(i)
        kind = it["inner"]["variant"]["kind"]
        name = "::".join(owner + (it["name"],))
        add = lambda text: self.line(owner, text, 1, it["name"])  # noqa: E731
        if kind == "plain":
            add(f"pub {name}")
        elif "tuple" in kind:
            field = lambda f: self.ty(self.item(f)["inner"]["struct_field"]) if f is not None else "_"  # noqa: E731
            add(f"pub {name}({', '.join(field(f) for f in kind['tuple'])})")
        else:
            add(f"{self.marks(it)}pub {name} {{ .. }}")
            for f in kind["struct"]["fields"]:
                fi = self.item(f)
                add(f"pub {name}::{fi['name']}: {self.ty(fi['inner']['struct_field'])}")

    def members(self, impls, owner):
        for i in impls:
            im = self.item(i)["inner"]["impl"]
            if im["blanket_impl"] is not None:
                continue
            if im["trait"] is None:
                for m in im["items"]:
                    mi = self.item(m)
                    if mi is not None and mi["visibility"] == "public":
                        self.assoc(m, owner)
                continue
            trait = im["trait"]
            if trait["path"].split("::")[-1] in HIDDEN_TRAITS:
                continue
            if im["is_synthetic"] and trait["path"].split("::")[-1] not in AUTO_TRAITS:
                continue
            params, where = self.generics(im["generics"])
            neg = "!" if im["is_negative"] else ""
            # Named by the path listed, so that each path has its own line.
            target = im["for"]
            if "resolved_path" in target:
                target = "::".join(owner) + self.args(target["resolved_path"].get("args"))
            else:
                target = self.ty(target)
            self.line(owner, f"impl{params} {neg}{self.path(trait)} for {target}{where}", 2)

    def assoc(self, i, owner, in_trait=False):
        it = self.item(i)
        self.members_seen.add(i)
        kind, v = next(iter(it["inner"].items()))
        name = "::".join(owner + (it["name"],))
        if kind == "function":
            line = self.marks(it) + self.fn(name, v)
            line = line.replace("pub ", "", 1) if in_trait else line
        elif kind == "assoc_const":
            line = f"pub const {name}: {self.ty(v['type'])}"
        elif kind == "assoc_type":
            line = f"pub type {name}" + (f" = {self.ty(v['type'])}" if v.get("type") else "")
        else:
            return
        self.line(owner, line, 1, it["name"])

    def run(self):
        self.walk(self.root, (self.crate,))
        for i, paths in self.public_paths.items():
            for p in paths:
                self.emit(i, p)
        return [text for _, text in sorted((key, text) for text, key in self.lines.items())]


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: public-api.py <crate>.json")
    with open(sys.argv[1]) as f:
        doc = json.load(f)
    if doc.get("format_version") != TESTED_FORMAT:
        print(f"public-api.py: rustdoc JSON format {doc.get('format_version')}, written for "
              f"{TESTED_FORMAT}: check the listing", file=sys.stderr)
    api = Api(doc)
    lines = api.run()
    root = sum(1 for p in api.public_paths.values() for x in p if len(x) == 2)
    items = len(api.public_paths)
    members = len(api.members_seen)
    paths = sum(len(p) for p in api.public_paths.values())
    sys.stdout.write("\n".join(lines) + "\n")
    print(f"public-api.py: {len(lines)} lines; {items + members} public items: {items} with a path of "
          f"their own ({paths} paths, {root} at the crate root) and {members} methods, fields, "
          f"variants and associated items", file=sys.stderr)


if __name__ == "__main__":
    main()
