//! The library's modules form layers: no import cycle between its top-level modules, nor
//! between the modules inside one of them, two levels down (issue 12, docs/architecture.md,
//! "Modules of the library, in layers").
//!
//! Reads every source file of `src/` as text: a `crate::…` or `super::…` path outside comments
//! and unit tests is an edge from the file's module to the module it names.
//! An edge through a re-export counts as written (`crate::admin::X` is an edge to `admin` even
//! when `X` is defined elsewhere), since that is the dependency a reader sees.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file below `dir`, unit-test files (`tests.rs`) left out.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src/ is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs")
            && path.file_name().is_some_and(|n| n != "tests.rs")
        {
            out.push(path);
        }
    }
}

/// The module path of a file below `src/`: `store/mysql/mod.rs` → `["store", "mysql"]`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("below src/");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
        .collect();
    if parts
        .last()
        .is_some_and(|last| last == "mod" || last == "lib")
    {
        parts.pop();
    }
    parts
}

/// The path at the start of `s`: `a::b::C` → `["a", "b", "C"]`.
fn path(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = s;
    loop {
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if end == 0 {
            break;
        }
        out.push(rest[..end].to_owned());
        match rest[end..].strip_prefix("::") {
            Some(next) => rest = next,
            None => break,
        }
    }
    out
}

/// The paths (from the crate root) the code of one file names, with the line that names each.
fn edges_of(module: &[String], text: &str) -> Vec<(Vec<String>, String)> {
    // Unit tests at the end of a file may use anything.
    let code = text
        .split("#[cfg(test)]\nmod tests {")
        .next()
        .unwrap_or(text);
    let mut out = Vec::new();
    for line in code.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("//") {
            continue;
        }
        for (at, _) in line.match_indices("crate::") {
            out.push((path(&line[at + "crate::".len()..]), trimmed.to_owned()));
        }
        let mut rest = line;
        while let Some(at) = rest.find("super::") {
            // Only the first `super::` of a run: count the run, then take the name after it.
            let preceded = rest[..at].ends_with("::");
            let mut tail = &rest[at..];
            let mut ups = 0;
            while let Some(t) = tail.strip_prefix("super::") {
                ups += 1;
                tail = t;
            }
            if !preceded && ups <= module.len() {
                let mut target = module[..module.len() - ups].to_vec();
                target.extend(path(tail));
                out.push((target, trimmed.to_owned()));
            }
            rest = tail;
        }
    }
    out
}

/// The modules at `depth` (1: `store`, 2: `store::admin`, …) and, for each, the modules at that
/// depth its files name, each with one line that names it.
fn graph_at(
    src: &Path,
    files: &[PathBuf],
    depth: usize,
) -> BTreeMap<String, BTreeMap<String, String>> {
    let modules: BTreeSet<Vec<String>> = files
        .iter()
        .map(|f| module_of(src, f))
        .filter(|m| m.len() >= depth)
        .map(|m| m[..depth].to_vec())
        .collect();
    let mut graph: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for file in files {
        let module = module_of(src, file);
        if module.len() < depth {
            continue; // lib.rs re-exports everything; a parent may name its children
        }
        let from = &module[..depth];
        let text = std::fs::read_to_string(file).expect("a readable source file");
        for (to, line) in edges_of(&module, &text) {
            if to.len() < depth {
                continue;
            }
            let to = &to[..depth];
            if to != from && modules.contains(to) {
                graph
                    .entry(from.join("::"))
                    .or_default()
                    .entry(to.join("::"))
                    .or_insert_with(|| format!("{}: {line}", file.display()));
            }
        }
    }
    graph
}

/// A cycle of `graph`, if any, as the modules along it (the first one again at the end).
fn cycle(graph: &BTreeMap<String, BTreeMap<String, String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeMap<String, String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flat_map(|e| e.keys()) {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[test]
fn modules_have_no_import_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let top = graph_at(&src, &files, 1);
    assert!(
        top.contains_key("store") && top.contains_key("relay"),
        "the walk found the library's modules: {:?}",
        top.keys().collect::<Vec<_>>()
    );
    // Top-level modules, then the modules inside each (`store::admin` and `store::postgres`,
    // `transport::config` and `transport::kafka`, …), then one level further.
    for depth in 1..=3 {
        let graph = graph_at(&src, &files, depth);
        if let Some(cycle) = cycle(&graph) {
            let named: Vec<String> = cycle
                .windows(2)
                .map(|w| format!("{} -> {}: {}", w[0], w[1], graph[&w[0]][&w[1]]))
                .collect();
            panic!(
                "import cycle between modules at depth {depth}:\n{}",
                named.join("\n")
            );
        }
    }
}
