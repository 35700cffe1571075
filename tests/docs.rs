//! Keeps the configuration reference true: every key the loader accepts is
//! documented in `docs/configuration.md`, and every example config loads.
//!
//! **Which keys.** The keys are not listed here: they are read from the loader.
//! A probe config with an unknown key `zz_probe` in a table makes serde refuse it
//! with "unknown field `zz_probe`, expected one of `a`, `b`, ..." (or
//! "expected `a`" / "expected `a` or `b`"); the names in backticks are that
//! table's keys. Each key is then probed in turn as a table (`k = { zz_probe = 1 }`),
//! an array of tables (`k = [{ zz_probe = 1 }]`) and a map of named tables
//! (`k = { NAME = { zz_probe = 1 } }`); when one of these is refused for
//! `zz_probe`, the key holds a table and its keys are read the same way. So a key
//! added to `src/config/raw.rs`, in any table old or new, is found without a
//! change here.
//!
//! **Where in the doc.** Each table's keys must appear, as `` `key` ``, in the
//! section of `docs/configuration.md` whose heading names the table in
//! backticks, as TOML writes its header: `` `[server]` ``, `` `[server.tls]` ``,
//! `` `[upstreams.NAME]` ``, `` `[[routes]]` ``, `` `[[policies.NAME.limits]]` ``
//! (the entries of `limits`), `` `[routes.respond]` ``. The top-level keys belong
//! to the section headed "The file". A section runs to the next heading of the
//! same or a higher level.
//!
//! **Which examples.** Every `*.toml` file in `examples/` is loaded as
//! `sluice check` loads it. Every ```` ```toml ```` block in `docs/*.md` and
//! `README.md` is loaded too (relative file names from the page's directory),
//! unless its first line starts with `# fragment` (`# fragment: the files must
//! exist`): mark so a block that shows part of a config and does not stand
//! alone.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const PROBE: &str = "zz_probe";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// One step from the top of the file to a table.
#[derive(Clone, Debug)]
enum Step {
    /// `key = { ... }`
    Table(String),
    /// `key = [{ ... }]`
    Array(String),
    /// `key = { NAME = { ... } }`
    Map(String),
}

/// A config whose table at `path` holds `inner` (inline TOML, without braces).
fn nest(path: &[Step], inner: &str) -> String {
    let mut value = format!("{{ {inner} }}");
    for step in path.iter().rev() {
        value = match step {
            Step::Table(k) => format!("{{ {k} = {value} }}"),
            Step::Array(k) => format!("{{ {k} = [{value}] }}"),
            Step::Map(k) => format!("{{ {k} = {{ NAME = {value} }} }}"),
        };
    }
    // The outermost braces are the file itself.
    let body = value
        .strip_prefix("{ ")
        .and_then(|v| v.strip_suffix(" }"))
        .expect("nest builds a table");
    format!("{body}\n")
}

/// The keys the loader lists for the table at `path`, or None when that is not
/// a table refusing `zz_probe`.
fn keys_of(path: &[Step]) -> Option<Vec<String>> {
    let text = nest(path, &format!("{PROBE} = 1"));
    let err = match sluice::config::parse(&text, "probe.toml", Path::new(".")) {
        Ok(_) => return None,
        Err(e) => e.to_string(),
    };
    let refused = format!("unknown field `{PROBE}`, expected ");
    let (_, expected) = err.split_once(&refused)?;
    let expected = expected.lines().next().unwrap_or_default();
    // "`a`", "`a` or `b`", "one of `a`, `b`, `c`"
    let keys: Vec<String> = expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect();
    assert!(!keys.is_empty(), "cannot read the keys in: {err}");
    Some(keys)
}

/// The table's header as TOML writes it: `[server.tls]`, `[[routes]]`.
fn header(path: &[Step]) -> String {
    let mut parts = Vec::new();
    for step in path {
        match step {
            Step::Table(k) | Step::Array(k) => parts.push(k.clone()),
            Step::Map(k) => {
                parts.push(k.clone());
                parts.push("NAME".to_string());
            }
        }
    }
    match path.last() {
        None => "The file".to_string(),
        Some(Step::Array(_)) => format!("`[[{}]]`", parts.join(".")),
        Some(_) => format!("`[{}]`", parts.join(".")),
    }
}

/// Every table the loader accepts, by header, with its keys.
fn accepted_keys() -> BTreeMap<String, Vec<String>> {
    let mut tables = BTreeMap::new();
    let mut todo: Vec<Vec<Step>> = vec![Vec::new()];
    while let Some(path) = todo.pop() {
        let keys = keys_of(&path).unwrap_or_else(|| panic!("{path:?} is not a table"));
        for key in &keys {
            for step in [
                Step::Table(key.clone()),
                Step::Array(key.clone()),
                Step::Map(key.clone()),
            ] {
                let mut inner = path.clone();
                inner.push(step);
                if keys_of(&inner).is_some() {
                    todo.push(inner);
                    break;
                }
            }
        }
        assert!(
            tables.insert(header(&path), keys).is_none(),
            "two tables with the header {}",
            header(&path)
        );
    }
    tables
}

/// The text of the section whose heading contains `name`.
fn section<'a>(doc: &'a str, name: &str) -> Option<&'a str> {
    let level = |line: &str| line.chars().take_while(|&c| c == '#').count();
    let mut start = None;
    let mut offset = 0;
    for line in doc.split_inclusive('\n') {
        let l = level(line);
        match start {
            None if l > 0 && line.contains(name) => start = Some((offset, l)),
            Some((from, at)) if l > 0 && l <= at => return Some(&doc[from..offset]),
            _ => {}
        }
        offset += line.len();
    }
    start.map(|(from, _)| &doc[from..])
}

/// The keys of `tables` that `doc` does not document under their table.
fn undocumented(doc: &str, tables: &BTreeMap<String, Vec<String>>) -> Vec<String> {
    let mut missing = Vec::new();
    for (header, keys) in tables {
        let Some(text) = section(doc, header) else {
            missing.push(format!("no section headed {header}"));
            continue;
        };
        for key in keys {
            if !text.contains(&format!("`{key}`")) {
                missing.push(format!("{header}: `{key}`"));
            }
        }
    }
    missing
}

#[test]
fn the_probe_finds_every_table_and_known_keys() {
    let tables = accepted_keys();
    let headers: Vec<&str> = tables.keys().map(String::as_str).collect();
    for expected in [
        "The file",
        "`[server]`",
        "`[server.tls]`",
        "`[store]`",
        "`[headers]`",
        "`[upstreams.NAME]`",
        "`[policies.NAME]`",
        "`[[policies.NAME.limits]]`",
        "`[[routes]]`",
        "`[routes.respond]`",
    ] {
        assert!(headers.contains(&expected), "{expected} not in {headers:?}");
    }
    assert!(tables["`[server]`"].contains(&"listen".to_string()));
    assert!(tables["`[headers]`"] == ["style"]);
    assert!(tables["`[[policies.NAME.limits]]`"].contains(&"burst".to_string()));
}

#[test]
fn every_accepted_key_is_in_the_configuration_reference() {
    let tables = accepted_keys();
    let doc = std::fs::read_to_string(root().join("docs/configuration.md")).unwrap();
    let missing = undocumented(&doc, &tables);
    assert!(
        missing.is_empty(),
        "docs/configuration.md does not document:\n  {}",
        missing.join("\n  ")
    );
    // The check itself notices a key left out.
    let without = doc.replace("`max_upstream_per_client`", "max_upstream_per_client");
    assert_eq!(
        undocumented(&without, &tables),
        ["`[server]`: `max_upstream_per_client`"]
    );
}

/// Each ```toml block of a Markdown page: its first line number and text.
fn toml_blocks(page: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, line) in page.lines().enumerate() {
        let fence = line.trim_start();
        match &mut current {
            None if fence.starts_with("```toml") => current = Some((i + 2, String::new())),
            Some(_) if fence.starts_with("```") => blocks.extend(current.take()),
            Some((_, text)) => {
                text.push_str(line);
                text.push('\n');
            }
            None => {}
        }
    }
    blocks
}

#[test]
fn every_example_config_passes_the_check() {
    let mut failed = Vec::new();
    let mut checked = Vec::new();
    let mut examples: Vec<PathBuf> = std::fs::read_dir(root().join("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    examples.sort();
    for path in &examples {
        match sluice::config::load(path) {
            Ok(_) => checked.push(format!("{}", path.display())),
            Err(e) => failed.push(e.to_string()),
        }
    }
    let mut pages = vec![root().join("README.md")];
    for entry in std::fs::read_dir(root().join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|x| x == "md") {
            pages.push(path);
        }
    }
    pages.sort();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        let base = page.parent().unwrap();
        for (line, block) in toml_blocks(&text) {
            if block.starts_with("# fragment") {
                continue;
            }
            // Padded to its place in the page, so errors name the page's line.
            let padded = "\n".repeat(line - 1) + &block;
            let name = page.strip_prefix(root()).unwrap_or(page).display();
            match sluice::config::parse(&padded, &name.to_string(), base) {
                Ok(_) => checked.push(format!("{name}:{line}")),
                Err(e) => failed.push(e.to_string()),
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    assert!(
        examples.len() >= 3,
        "only {} files in examples/",
        examples.len()
    );
    assert!(
        checked.iter().any(|n| n.contains("configuration.md")),
        "no whole config checked in docs/configuration.md: {checked:?}"
    );
}
