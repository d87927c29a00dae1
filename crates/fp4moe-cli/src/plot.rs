//! `time / floor` against batch size as an SVG line chart, log-scaled on both axes, one line per
//! backend or peer (`fp4moe bench --plot`, `fp4moe plot`).
//!
//! Inputs are benchmark JSON documents: `fp4moe bench --json` output (`backend`, `mode`, `preset`,
//! `results[] {tokens, median_us, memory_floor_us, compute_floor_us}`) or the PyTorch peer's
//! (`backend`, `preset`, `results[] {tokens, median_us}`). Every line is divided by the same
//! floor: DESIGN 5's NVFP4 floor, max(memory floor, bf16 compute floor) (a host backend's
//! document has a null compute floor: its memory floor alone), taken from the first fp4moe
//! document of the same preset at the same batch size, so lines compare times directly. Host
//! runs (`cpu`, `reference`) and GPU runs (fp4moe's `cuda`, the peer) are never mixed: their
//! floors belong to different machines.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// One line of the chart: `(tokens, time / floor)` points in increasing tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

struct Doc {
    name: String,
    preset: String,
    label: String,
    /// `(tokens, median µs, NVFP4 floor µs if the document has one)`.
    rows: Vec<(u64, f64, Option<f64>)>,
    /// Measured on the host (fp4moe's `cpu` or `reference` backend), not on a GPU.
    host: bool,
}

fn field<'a>(v: &'a Value, key: &str, at: &str) -> Result<&'a Value> {
    v.get(key)
        .with_context(|| format!("{at}: missing field `{key}`"))
}

fn number(v: &Value, key: &str, at: &str) -> Result<f64> {
    field(v, key, at)?
        .as_f64()
        .with_context(|| format!("{at}: field `{key}` is not a number"))
}

fn parse(name: &str, v: &Value) -> Result<Doc> {
    let text = |key: &str| -> Result<String> {
        Ok(field(v, key, name)?
            .as_str()
            .with_context(|| format!("{name}: field `{key}` is not a string"))?
            .to_string())
    };
    let backend = text("backend")?;
    let host = v.get("mode").is_some() && matches!(backend.as_str(), "cpu" | "reference");
    let preset = text("preset")?;
    let label = match v.get("mode").and_then(Value::as_str) {
        Some(mode) => format!("fp4moe {backend} {mode}"),
        None if backend.starts_with("torch") => "PyTorch bf16 grouped_mm".to_string(),
        None => backend,
    };
    let results = field(v, "results", name)?
        .as_array()
        .with_context(|| format!("{name}: field `results` is not a list"))?;
    let mut rows = Vec::new();
    for (i, r) in results.iter().enumerate() {
        let at = format!("{name}: results[{i}]");
        let tokens = number(r, "tokens", &at)?;
        if !(tokens >= 1.0 && tokens.fract() == 0.0) {
            bail!("{at}: `tokens` must be a positive integer, got {tokens}");
        }
        let median = number(r, "median_us", &at)?;
        if !(median > 0.0 && median.is_finite()) {
            bail!("{at}: `median_us` must be positive, got {median}");
        }
        // Only fp4moe documents carry the NVFP4 floor (the peer's own floor is bf16).
        let floor = if v.get("mode").is_some() {
            let m = number(r, "memory_floor_us", &at)?;
            // A host backend's document has no compute floor (null): memory alone.
            match r.get("compute_floor_us") {
                Some(Value::Null) => Some(m),
                _ => Some(m.max(number(r, "compute_floor_us", &at)?)),
            }
        } else {
            None
        };
        rows.push((tokens as u64, median, floor));
    }
    Ok(Doc {
        name: name.to_string(),
        preset,
        label,
        rows,
        host,
    })
}

/// The chart's lines from `(file name, document)` pairs, all of one preset.
pub fn series(docs: &[(String, Value)]) -> Result<(String, Vec<Series>)> {
    let parsed: Vec<Doc> = docs
        .iter()
        .map(|(n, v)| parse(n, v))
        .collect::<Result<_>>()?;
    let Some(first) = parsed.first() else {
        bail!("no benchmark documents to plot");
    };
    if let Some(other) = parsed.iter().find(|d| d.preset != first.preset) {
        bail!(
            "{} is preset `{}` but {} is `{}`: plot one preset at a time",
            other.name,
            other.preset,
            first.name,
            first.preset
        );
    }
    // One floor divides every line, so every document must come from one kind of machine: a
    // host run's floor is this machine's memory, a GPU run's (and the peer's) the device's.
    if let Some(other) = parsed.iter().find(|d| d.host != first.host) {
        let (host, gpu) = if other.host {
            (other, first)
        } else {
            (first, other)
        };
        bail!(
            "{} was measured on the host and {} on a GPU: their floors are different machines', plot them apart",
            host.name,
            gpu.name
        );
    }
    let mut floors: BTreeMap<u64, f64> = BTreeMap::new();
    for d in &parsed {
        for &(t, _, f) in &d.rows {
            if let Some(f) = f {
                floors.entry(t).or_insert(f);
            }
        }
    }
    if floors.is_empty() {
        bail!("no fp4moe document (with NVFP4 floors) among the inputs: nothing to divide by");
    }
    let lines = parsed
        .iter()
        .map(|d| {
            let mut points: Vec<(f64, f64)> = d
                .rows
                .iter()
                .filter_map(|&(t, med, _)| floors.get(&t).map(|f| (t as f64, med / f)))
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            Series {
                label: d.label.clone(),
                points,
            }
        })
        .filter(|s| !s.points.is_empty())
        .collect();
    Ok((first.preset.clone(), lines))
}

/// Reads benchmark JSON files.
pub fn read_docs(paths: &[impl AsRef<Path>]) -> Result<Vec<(String, Value)>> {
    paths
        .iter()
        .map(|p| {
            let p = p.as_ref();
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let v: Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: not JSON", p.display()))?;
            Ok((p.display().to_string(), v))
        })
        .collect()
}

const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The chart as an SVG document.
pub fn svg(title: &str, lines: &[Series]) -> String {
    let (w, h) = (720.0, 440.0);
    let (left, right, top, bottom) = (70.0, 20.0, 40.0, 60.0);
    let pts = lines.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, 1.0f64, 1.0f64);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1) = (1.0, 2.0);
    }
    if x1 <= x0 {
        x1 = x0 * 2.0;
    }
    let (lx0, lx1) = (x0.log2(), x1.log2());
    let (ly0, ly1) = ((y0 / 1.2).log10(), (y1 * 1.2).log10());
    let px = |x: f64| left + (x.log2() - lx0) / (lx1 - lx0) * (w - left - right);
    let py = |y: f64| h - bottom - (y.log10() - ly0) / (ly1 - ly0) * (h - top - bottom);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
         viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">{}</text>\n",
        w / 2.0,
        escape(title)
    );
    // Axes, x ticks at the measured batch sizes, y ticks at 1-2-5 decades.
    s += &format!(
        "<path d=\"M{left} {top} V{} H{}\" stroke=\"black\" fill=\"none\"/>\n",
        h - bottom,
        w - right
    );
    let mut xs: Vec<f64> = lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.0))
        .collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    for x in xs {
        s += &format!(
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{x}</text>\n",
            px(x),
            h - bottom + 16.0
        );
    }
    let mut decade = 10f64.powf(ly0.floor());
    while decade <= 10f64.powf(ly1) {
        for m in [1.0, 2.0, 5.0] {
            let y = decade * m;
            if y.log10() >= ly0 && y.log10() <= ly1 {
                let (xr, yy, xl, yt) = (w - right, py(y), left - 6.0, py(y) + 4.0);
                s += &format!(
                    "<line x1=\"{left}\" x2=\"{xr}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"#ddd\"/>\n\
                     <text x=\"{xl}\" y=\"{yt:.1}\" text-anchor=\"end\">{y}</text>\n"
                );
            }
        }
        decade *= 10.0;
    }
    let (xr, y_floor) = (w - right, py(1.0));
    s += &format!(
        "<line x1=\"{left}\" x2=\"{xr}\" y1=\"{y_floor:.1}\" y2=\"{y_floor:.1}\" stroke=\"black\" stroke-dasharray=\"4 3\"/>\n"
    );
    s += &format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">tokens per call (log scale)</text>\n\
         <text transform=\"translate(18 {}) rotate(-90)\" text-anchor=\"middle\">time / NVFP4 floor (log scale; dashed: the floor)</text>\n",
        (left + w - right) / 2.0,
        h - 20.0,
        (top + h - bottom) / 2.0
    );
    for (i, l) in lines.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let path: Vec<String> = l
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        s += &format!(
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{c}\" stroke-width=\"2\"/>\n",
            path.join(" ")
        );
        for &(x, y) in &l.points {
            s += &format!(
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{c}\"/>\n",
                px(x),
                py(y)
            );
        }
        // Legend in the top right corner, where time/floor is lowest at large batches.
        let (ly, lx) = (top + 14.0 + 16.0 * i as f64, w - right - 250.0);
        s += &format!(
            "<line x1=\"{}\" x2=\"{}\" y1=\"{ly}\" y2=\"{ly}\" stroke=\"{c}\" stroke-width=\"2\"/>\n\
             <text x=\"{}\" y=\"{}\">{}</text>\n",
            lx,
            lx + 24.0,
            lx + 30.0,
            ly + 4.0,
            escape(&l.label)
        );
    }
    s += "</svg>\n";
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fp4(mode: &str, rows: &[(u64, f64, f64)]) -> Value {
        json!({"backend": "cuda", "mode": mode, "preset": "p", "results": rows.iter().map(|&(t, m, f)| json!({
            "tokens": t, "median_us": m, "memory_floor_us": f, "compute_floor_us": f / 2.0})).collect::<Vec<_>>()})
    }

    #[test]
    fn lines_share_the_fp4moe_floor() {
        let a = fp4("w4a16", &[(1, 50.0, 10.0), (8, 80.0, 40.0)]);
        let torch = json!({"backend": "torch-bf16", "preset": "p", "results": [
            {"tokens": 1, "median_us": 100.0}, {"tokens": 8, "median_us": 120.0}, {"tokens": 64, "median_us": 9.0}]});
        let (preset, lines) = series(&[("a.json".into(), a), ("t.json".into(), torch)]).unwrap();
        assert_eq!(preset, "p");
        assert_eq!(lines[0].label, "fp4moe cuda w4a16");
        assert_eq!(lines[0].points, vec![(1.0, 5.0), (8.0, 2.0)]);
        // The peer is divided by the same floor; T=64 has none and is left out.
        assert_eq!(lines[1].label, "PyTorch bf16 grouped_mm");
        assert_eq!(lines[1].points, vec![(1.0, 10.0), (8.0, 3.0)]);
        let text = svg("title <x>", &lines);
        assert!(text.starts_with("<svg") && text.ends_with("</svg>\n"));
        assert!(text.contains("PyTorch bf16 grouped_mm") && text.contains("title &lt;x&gt;"));
        assert_eq!(text.matches("<polyline").count(), 2);
    }

    #[test]
    fn a_host_document_without_compute_floor_uses_its_memory_floor() {
        let cpu = json!({"backend": "cpu", "mode": "w4a16", "preset": "p", "results": [
            {"tokens": 1, "median_us": 300.0, "memory_floor_us": 100.0, "compute_floor_us": null},
            {"tokens": 8, "median_us": 900.0, "memory_floor_us": 200.0, "compute_floor_us": null}]});
        let (_, lines) = series(&[("cpu.json".into(), cpu)]).unwrap();
        assert_eq!(lines[0].points, vec![(1.0, 3.0), (8.0, 4.5)]);
        // A missing memory floor is still an error that names the field.
        let bad = json!({"backend": "cpu", "mode": "w4a16", "preset": "p", "results": [
            {"tokens": 1, "median_us": 3.0, "memory_floor_us": null, "compute_floor_us": null}]});
        let e = series(&[("c.json".into(), bad)]).unwrap_err().to_string();
        assert!(
            e.contains("c.json: results[0]") && e.contains("memory_floor_us"),
            "{e}"
        );
        // Host and GPU runs (fp4moe's or the peer's) do not share a floor.
        let cpu = json!({"backend": "cpu", "mode": "w4a16", "preset": "p", "results": [
            {"tokens": 1, "median_us": 300.0, "memory_floor_us": 100.0, "compute_floor_us": null}]});
        let torch = json!({"backend": "torch-bf16", "preset": "p", "results": [{"tokens": 1, "median_us": 1.0}]});
        for other in [fp4("w4a16", &[(1, 1.0, 1.0)]), torch] {
            let e = series(&[("cpu.json".into(), cpu.clone()), ("g.json".into(), other)])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("cpu.json was measured on the host and g.json on a GPU"),
                "{e}"
            );
        }
    }

    #[test]
    fn bad_documents_are_named() {
        let e = series(&[("x.json".into(), json!({"backend": "cuda", "preset": "p"}))])
            .unwrap_err()
            .to_string();
        assert!(e.contains("x.json") && e.contains("results"), "{e}");
        let bad = json!({"backend": "cuda", "mode": "w4a16", "preset": "p",
            "results": [{"tokens": 0, "median_us": 1.0, "memory_floor_us": 1.0, "compute_floor_us": 1.0}]});
        let e = series(&[("y.json".into(), bad)]).unwrap_err().to_string();
        assert!(
            e.contains("y.json: results[0]") && e.contains("tokens"),
            "{e}"
        );
        let torch_only = json!({"backend": "torch", "preset": "p", "results": [{"tokens": 1, "median_us": 1.0}]});
        assert!(series(&[("t.json".into(), torch_only)]).is_err());
        let other = fp4("w4a4", &[(1, 1.0, 1.0)]);
        let mut o = other.clone();
        o["preset"] = json!("q");
        assert!(series(&[("a".into(), other), ("b".into(), o)]).is_err());
        assert!(series(&[]).is_err());
    }
}
