//! The text tables of `outbox bench` and the formats of their cells.

/// A text table: the first column left-aligned, the others right-aligned, columns separated by
/// two spaces, a rule under the header.
#[derive(Debug, Clone, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column titles.
    pub fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Table {
        Table {
            header: header.into_iter().map(Into::into).collect(),
            rows: Vec::new(),
        }
    }

    /// Add a row; missing cells are blank, extra cells are kept (and widen the table).
    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        self.rows.push(cells.into_iter().map(Into::into).collect());
    }

    /// Whether no row was added.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The table as lines of text, each ending in `\n`.
    pub fn render(&self) -> String {
        let columns = std::iter::once(&self.header)
            .chain(&self.rows)
            .map(Vec::len)
            .max()
            .unwrap_or(0);
        let mut widths = vec![0usize; columns];
        for r in std::iter::once(&self.header).chain(&self.rows) {
            for (i, c) in r.iter().enumerate() {
                widths[i] = widths[i].max(c.chars().count());
            }
        }
        let line = |r: &[String]| {
            let cells: Vec<String> = (0..columns)
                .map(|i| {
                    let c = r.get(i).map(String::as_str).unwrap_or("");
                    if i == 0 {
                        format!("{c:<w$}", w = widths[i])
                    } else {
                        format!("{c:>w$}", w = widths[i])
                    }
                })
                .collect();
            format!("{}\n", cells.join("  ").trim_end())
        };
        let mut out = line(&self.header);
        let total = widths.iter().sum::<usize>() + 2 * columns.saturating_sub(1);
        out.push_str(&"-".repeat(total));
        out.push('\n');
        for r in &self.rows {
            out.push_str(&line(r));
        }
        out
    }
}

/// A count with thousands separators: `1234567.8` → `1,234,568`.
pub fn fmt_count(v: f64) -> String {
    if !v.is_finite() {
        return "-".into();
    }
    let n = v.round().abs() as u64;
    let digits = n.to_string();
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    if v.round() < 0.0 {
        out.insert(0, '-');
    }
    out
}

/// A ratio as `1.52x`, or `-`.
pub fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "-".into(), |r| format!("{r:.2}x"))
}

/// Milliseconds with two decimals, or `-`.
pub fn fmt_ms(v: Option<f64>) -> String {
    fmt_fixed(v, 2)
}

/// A number with `decimals` decimals, or `-`.
pub fn fmt_fixed(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.decimals$}"))
}

/// Bytes in MiB with one decimal.
pub fn fmt_mib(bytes: i64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// The 1-minute load, or `-`.
pub fn fmt_load(load: Option<[f64; 3]>) -> String {
    load.map_or_else(|| "-".into(), |l| format!("{:.2}", l[0]))
}
