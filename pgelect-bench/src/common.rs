//! What the benchmarks share: a child process of this binary, a plain
//! connection, and nearest-rank statistics.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio_postgres::NoTls;

/// A plain tokio-postgres connection (its driver spawned).
pub(crate) async fn connect(url: &str) -> Result<tokio_postgres::Client, String> {
    let (client, conn) = tokio_postgres::connect(url, NoTls)
        .await
        .map_err(|e| format!("cannot connect: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

/// A child process of this benchmark binary and the lines it prints.
pub(crate) struct ChildProc {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl ChildProc {
    /// Runs this benchmark binary as `<bench> --child ARGS…`.
    pub(crate) fn spawn(bench: &str, args: &[&str]) -> Result<ChildProc, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .arg(bench)
            .arg("--child")
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot spawn a child: {e}"))?;
        let out = child.stdout.take().expect("BUG: piped stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Ok(ChildProc { child, lines })
    }

    /// Waits for a line starting with `prefix`.
    pub(crate) async fn expect(&self, prefix: &str, within: Duration) -> Result<String, String> {
        let deadline = Instant::now() + within;
        loop {
            match self.lines.try_recv() {
                Ok(l) if l.starts_with(prefix) => return Ok(l),
                Ok(_) => {}
                Err(std::sync::mpsc::TryRecvError::Empty) => {
                    if Instant::now() > deadline {
                        return Err(format!("child printed no {prefix:?} within {within:?}"));
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err(e) => return Err(format!("child ended before {prefix:?}: {e}")),
            }
        }
    }

    pub(crate) fn kill9(&mut self) -> Result<(), String> {
        self.child
            .kill()
            .map_err(|e| format!("cannot SIGKILL the child: {e}"))
    }

    /// Waits for the child to exit (after [`kill9`](Self::kill9)) and
    /// returns the lines it printed that no `expect` consumed. Blocks the
    /// thread briefly (a killed child exits at once).
    pub(crate) fn wait_lines(&mut self) -> Result<Vec<String>, String> {
        tokio::task::block_in_place(|| {
            self.child
                .wait()
                .map_err(|e| format!("cannot wait for the child: {e}"))?;
            // The reader drops its sender at end of file.
            Ok(self.lines.iter().collect())
        })
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// p50, p99, min and max of a series.
pub(crate) struct Stats {
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
}

impl Stats {
    /// Nearest-rank percentiles.
    pub(crate) fn of(samples: &[f64]) -> Stats {
        let mut v = samples.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        let rank = |p: f64| {
            let i = ((p / 100.0) * v.len() as f64).ceil() as usize;
            v[i.clamp(1, v.len()) - 1]
        };
        Stats {
            p50: rank(50.0),
            p99: rank(99.0),
            min: v[0],
            max: v[v.len() - 1],
        }
    }

    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "p50": round2(self.p50), "p99": round2(self.p99),
            "min": round2(self.min), "max": round2(self.max),
        })
    }
}

/// The number after an option (`--window 30`), at least `min`; the
/// error names the benchmark and the option.
pub(crate) fn option_number<'a>(
    args: &mut impl Iterator<Item = &'a String>,
    bench: &str,
    option: &str,
    min: f64,
) -> Result<f64, String> {
    args.next()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|v| *v >= min)
        .ok_or(format!("{bench}: {option} needs a number, at least {min}"))
}

pub(crate) fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// The figures of one benchmark as `scripts/bench` collects them: a list
/// of `{scenario, metric, value, unit}` rows (baselines are rows of their
/// own scenario) and, for latency series, the samples `report` plots.
#[derive(Default)]
pub(crate) struct Rows {
    rows: Vec<serde_json::Value>,
    samples: serde_json::Map<String, serde_json::Value>,
}

impl Rows {
    /// One figure.
    pub(crate) fn push(&mut self, scenario: &str, metric: &str, value: f64, unit: &str) {
        self.rows.push(serde_json::json!({
            "scenario": scenario, "metric": metric, "value": round2(value), "unit": unit,
        }));
    }

    /// p50, p99, min and max of a latency series (milliseconds), and the
    /// samples for the plot.
    pub(crate) fn latency(&mut self, scenario: &str, ms: &[f64]) {
        if ms.is_empty() {
            return;
        }
        let s = Stats::of(ms);
        for (metric, v) in [
            ("p50", s.p50),
            ("p99", s.p99),
            ("min", s.min),
            ("max", s.max),
        ] {
            self.push(scenario, metric, v, "ms");
        }
        self.push(scenario, "trials", ms.len() as f64, "count");
        self.samples.insert(
            scenario.to_owned(),
            ms.iter().map(|v| round2(*v)).collect::<Vec<_>>().into(),
        );
    }

    /// Adds `rows` and `samples` to a benchmark's JSON line.
    pub(crate) fn attach(self, line: &mut serde_json::Value) {
        line["rows"] = self.rows.into();
        line["samples"] = self.samples.into();
    }
}
