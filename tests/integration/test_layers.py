"""The daemon's layers call only downward (docs/architecture.md, "Layers"): the front ends (data
plane, admin API) reach L1, L2 and the lookup sessions only through the engine API, the engine
and what lies below it never include a front end, and the error-buffer conventions hold in the
files of the engine and its front ends. A source check: it needs no binary."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVER = ROOT / "src" / "server"
FRONT_ENDS = ("dataplane", "admin")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def sources(*dirs):
    for d in dirs:
        yield from sorted(p for p in (SERVER / d).glob("*.[ch]"))


def below_engine():
    """Every server source under the engine: L1, L2, sessions, kvctx, keys, config."""
    files = [p for p in SERVER.glob("*.[ch]")
             if p.stem not in ("engine", "engine_data", "engine_internal", "server")]
    return files + list(sources("l1", "l2"))


def test_front_ends_never_reach_into_l1_or_l2():
    hits = []
    for p in sources(*FRONT_ENDS):
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"l1_|l2ctl_|l2_adapter", line):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert hits == []


def test_front_ends_include_no_cache_or_session_header():
    bad = []
    for p in sources(*FRONT_ENDS):
        for inc in INCLUDE.findall(p.read_text()):
            if inc.startswith(("server/l1/", "server/l2/")) or inc == "server/session.h":
                bad.append(f"{p.relative_to(ROOT)} includes {inc}")
    assert bad == []


def test_front_ends_do_not_include_each_other():
    bad = []
    for mine, other in (("dataplane", "admin"), ("admin", "dataplane")):
        for p in sources(mine):
            for inc in INCLUDE.findall(p.read_text()):
                if inc.startswith(f"server/{other}/"):
                    bad.append(f"{p.relative_to(ROOT)} includes {inc}")
    assert bad == []


def test_the_engine_includes_no_front_end():
    bad = []
    for p in [SERVER / "engine.c", SERVER / "engine.h"] + below_engine():
        for inc in INCLUDE.findall(p.read_text()):
            if inc.startswith(("server/dataplane/", "server/admin/")) or inc == "server/server.h":
                bad.append(f"{p.relative_to(ROOT)} includes {inc}")
    assert bad == []


def test_nothing_below_the_engine_includes_it():
    bad = [f"{p.relative_to(ROOT)}" for p in below_engine()
           if "server/engine.h" in INCLUDE.findall(p.read_text())]
    assert bad == []


def test_error_buffers_are_filled_with_errbuf_set():
    files = [SERVER / "engine.c", SERVER / "engine_data.c", SERVER / "engine.h",
             SERVER / "session.c", SERVER / "kvctx.c",
             SERVER / "kvctx.h"] + list(sources("dataplane"))
    files += [SERVER / "admin" / f for f in ("l2_api.c", "reconfigure_api.c", "cache_api.c",
                                             "info_api.c")]
    bad = []
    for p in files:
        text = p.read_text()
        for n, line in enumerate(text.splitlines(), 1):
            if re.search(r"\bv?snprintf\(err(buf)?, errlen", line) or "char *errbuf" in line:
                bad.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert bad == []


# Files still written the old way; the checks below allow them, and only them.
OLD_ERRBUF = {"src/client/umbp_client.c"}
OLD_CLEANSE = {"src/server/dataplane/dataplane.c", "src/server/dataplane/curve.c"}


def all_sources():
    return sorted(p for p in (ROOT / "src").rglob("*.[ch]"))


def test_every_error_buffer_is_named_err_and_filled_with_errbuf_set():
    """Everywhere in src/: an error-buffer parameter is `char *err, size_t errlen`, and a
    message goes into one (or into a local `char err[]`) through errbuf_set, never by hand."""
    bad = []
    for p in all_sources():
        rel = str(p.relative_to(ROOT))
        if rel in ("src/base/errbuf.c", ) or rel in OLD_ERRBUF:
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if (re.search(r"\bv?snprintf\(err\w*, *(errlen|sizeof)", line)
                    or re.search(r"char \*\w*err\w*, *size_t (?!errlen\b)\w+", line)
                    or re.search(r"char \*(errbuf|errmsg|error)\b, *size_t", line)):
                bad.append(f"{rel}:{n}: {line.strip()}")
    assert bad == []


def test_secrets_are_wiped_with_explicit_bzero():
    """One way to wipe a secret before its memory is freed: explicit_bzero (not OPENSSL_cleanse,
    not memset, which the compiler may drop)."""
    bad = []
    for p in all_sources():
        rel = str(p.relative_to(ROOT))
        if rel in OLD_CLEANSE:
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if "OPENSSL_cleanse(" in line:
                bad.append(f"{rel}:{n}: {line.strip()}")
    assert bad == []


def test_l1_internal_header_stays_inside_l1():
    """src/server/l1/l1_internal.h is private to the L1 files; everyone else includes l1.h."""
    bad = []
    for p in list(all_sources()) + sorted((ROOT / "tests").rglob("*.[ch]")):
        if p.parent == SERVER / "l1":
            continue
        if "server/l1/l1_internal.h" in INCLUDE.findall(p.read_text()):
            bad.append(str(p.relative_to(ROOT)))
    assert bad == []


def test_prompt_keys_are_made_in_one_place():
    """A prompt's chunks become object keys (per rank, interned or not) only in the engine's
    prompt_key: lookups, stores, retrieves and warm prefetches share it."""
    calls = []
    for p in list(SERVER.glob("*.c")) + list(sources(*FRONT_ENDS)):
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"\bl1_key_(make|lookup)\(|\bmake_key2?\(", line):
                calls.append(f"{p.relative_to(ROOT)}:{n}")
    assert len(calls) == 2 and all(c.startswith("src/server/engine_data.c:") for c in calls), calls


def test_architecture_layout_places_every_source_file():
    """docs/architecture.md's layout names every file under src/ (by file name or stem, or as
    name.[ch]), so a reader finds where a behaviour lives from that one section."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    layout = doc[doc.index("## Layout"):doc.index("## Data flow")]
    words = set()
    for w in re.findall(r"[A-Za-z0-9_.\[\]]+", layout):
        words.update((w, w.split(".")[0]))
    missing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "src").rglob("*"))
               if p.is_file() and p.name.split(".")[0] not in words]
    assert missing == []
