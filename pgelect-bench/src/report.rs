//! `report`: merges what the benchmarks printed into one list of
//! `{scenario, metric, value, unit}` rows, prints them as a table and draws
//! the latency distributions as an SVG.
//!
//! Input files hold the output of `pgelect-bench <benchmark> --json`; any
//! line that is a JSON object with a `rows` array counts, everything else is
//! ignored. `scripts/bench` runs every benchmark and then this.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use plotters::prelude::*;

struct Options {
    inputs: Vec<String>,
    json: Option<String>,
    svg: Option<String>,
    title: String,
}

fn parse(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        inputs: Vec::new(),
        json: None,
        svg: None,
        title: "pgelect benchmarks".to_owned(),
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match a.as_str() {
            "--json" => o.json = Some(value("--json")?),
            "--svg" => o.svg = Some(value("--svg")?),
            "--title" => o.title = value("--title")?,
            s if s.starts_with('-') => return Err(format!("report: unknown option {s:?}")),
            s => o.inputs.push(s.to_owned()),
        }
    }
    if o.inputs.is_empty() {
        return Err("report: give the files holding the benchmarks' --json output".into());
    }
    Ok(o)
}

/// One figure.
struct Row {
    scenario: String,
    metric: String,
    value: f64,
    unit: String,
}

/// Entry point: `report [--json FILE] [--svg FILE] [--title T] INPUT…`.
pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let o = parse(args)?;
    let mut rows = Vec::new();
    let mut samples: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for path in &o.inputs {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
        let mut found = false;
        for line in text.lines().filter(|l| l.trim_start().starts_with('{')) {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let Some(list) = v.get("rows").and_then(|r| r.as_array()) else {
                continue;
            };
            found = true;
            for r in list {
                rows.push(row(r).ok_or_else(|| format!("{path}: a row is malformed: {r}"))?);
            }
            if let Some(map) = v.get("samples").and_then(|s| s.as_object()) {
                for (k, list) in map {
                    let ms: Vec<f64> = list
                        .as_array()
                        .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
                        .unwrap_or_default();
                    samples.insert(k.clone(), ms);
                }
            }
        }
        if !found {
            return Err(format!("{path}: no benchmark output with rows in it"));
        }
    }
    print!("{}", table(&rows));
    if let Some(path) = &o.json {
        let list: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "scenario": r.scenario, "metric": r.metric, "value": r.value, "unit": r.unit,
                })
            })
            .collect();
        let text = serde_json::to_string_pretty(&list).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n").map_err(|e| format!("cannot write {path}: {e}"))?;
        println!("{} rows written to {path}", list.len());
    }
    match &o.svg {
        Some(_) if samples.values().all(|v| v.is_empty()) => {
            println!("no latency distributions in these benchmarks: no plot drawn");
        }
        Some(path) => {
            plot(path, &o.title, &samples)?;
            println!("latency distributions drawn in {path}");
        }
        None => {}
    }
    Ok(())
}

fn row(v: &serde_json::Value) -> Option<Row> {
    Some(Row {
        scenario: v.get("scenario")?.as_str()?.to_owned(),
        metric: v.get("metric")?.as_str()?.to_owned(),
        value: v.get("value")?.as_f64()?,
        unit: v.get("unit")?.as_str()?.to_owned(),
    })
}

/// One line per scenario: its metrics side by side.
fn table(rows: &[Row]) -> String {
    let mut by: Vec<(&str, Vec<&Row>)> = Vec::new();
    for r in rows {
        match by.iter_mut().find(|(s, _)| *s == r.scenario) {
            Some((_, list)) => list.push(r),
            None => by.push((&r.scenario, vec![r])),
        }
    }
    let width = by.iter().map(|(s, _)| s.len()).max().unwrap_or(8).max(8);
    let mut out = String::new();
    let _ = writeln!(out, "{:<width$}  figures", "scenario");
    for (scenario, list) in by {
        let cells: Vec<String> = list
            .iter()
            .map(|r| format!("{} {}{}", r.metric, number(r.value), unit(&r.unit)))
            .collect();
        let _ = writeln!(out, "{scenario:<width$}  {}", cells.join(", "));
    }
    out
}

fn number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else if v.abs() >= 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn unit(u: &str) -> String {
    match u {
        "count" | "x" | "" => String::new(),
        u => format!(" {u}"),
    }
}

/// The distributions as cumulative curves, one panel per benchmark: the
/// share of trials (y) that took at most x milliseconds, x on a log scale.
fn plot(path: &str, title: &str, samples: &BTreeMap<String, Vec<f64>>) -> Result<(), String> {
    let mut groups: BTreeMap<&str, Vec<(&str, &Vec<f64>)>> = BTreeMap::new();
    for (k, v) in samples.iter().filter(|(_, v)| !v.is_empty()) {
        let (group, series) = k.split_once('/').unwrap_or((k.as_str(), k.as_str()));
        groups.entry(group).or_default().push((series, v));
    }
    let cols = groups.len().clamp(1, 2);
    let rows = groups.len().div_ceil(cols);
    let size = (640 * cols as u32, 60 + 360 * rows as u32);
    let err = |e: &dyn std::fmt::Display| format!("cannot draw {path}: {e}");
    let root = SVGBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(|e| err(&e))?;
    let panels = root.split_evenly((rows, cols));
    for ((group, series), panel) in groups.iter().zip(panels.iter()) {
        let all = series.iter().flat_map(|(_, v)| v.iter().copied());
        let (lo, hi) = all.fold((f64::MAX, 0f64), |(lo, hi), x| (lo.min(x), hi.max(x)));
        let (lo, hi) = ((lo * 0.8).max(0.01), (hi * 1.25).max(lo * 2.0).max(0.02));
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{group} (ms, log scale)"), ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(32)
            .y_label_area_size(44)
            .build_cartesian_2d((lo..hi).log_scale(), 0f64..100f64)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("milliseconds")
            .y_desc("% of trials at most")
            .draw()
            .map_err(|e| err(&e))?;
        for (i, (name, v)) in series.iter().enumerate() {
            let mut sorted = v.to_vec();
            sorted.sort_by(f64::total_cmp);
            let n = sorted.len() as f64;
            let color = Palette99::pick(i).to_rgba();
            let points = sorted
                .iter()
                .enumerate()
                .map(|(k, x)| (*x, 100.0 * (k + 1) as f64 / n));
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(format!("{name} (n={})", sorted.len()))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_become_a_table_and_a_plot() {
        let dir = std::env::temp_dir().join(format!("pgelect-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let input = dir.join("out.txt");
        let line = serde_json::json!({
            "bench": "x",
            "rows": [
                {"scenario": "failover/crash", "metric": "p50", "value": 12.5, "unit": "ms"},
                {"scenario": "failover/baseline", "metric": "p50", "value": 3.0, "unit": "ms"},
            ],
            "samples": {"failover/crash": [10.0, 12.5, 40.0], "failover/baseline": [2.0, 3.0]},
        });
        std::fs::write(&input, format!("a table for people\n{line}\n")).unwrap();
        let json = dir.join("rows.json");
        let svg = dir.join("plot.svg");
        let args: Vec<String> = vec![
            input.display().to_string(),
            "--json".into(),
            json.display().to_string(),
            "--svg".into(),
            svg.display().to_string(),
        ];
        run(&args).unwrap();
        let rows: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(rows.as_array().unwrap().len(), 2);
        assert_eq!(rows[0]["scenario"], "failover/crash");
        assert_eq!(rows[0]["value"], 12.5);
        let drawn = std::fs::read_to_string(&svg).unwrap();
        assert!(
            drawn.contains("<svg") && drawn.contains("crash (n=3)"),
            "{drawn}"
        );
        // Output without rows is an error, not an empty report.
        std::fs::write(&input, "nothing\n").unwrap();
        assert!(run(&args).unwrap_err().contains("no benchmark output"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
