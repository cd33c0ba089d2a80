//! Helpers shared by the election test binaries: acting intervals on one
//! clock, and leader processes (the `candidate` example) to kill or freeze.
//! Each test binary uses a part of it.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use pgelect::{ConnectOptions, Elector, ElectorBuilder, Term};
use pgelect_testkit::TestDb;

/// One leader's acting interval: node, term, start, end.
pub type Interval = (String, Term, Instant, Option<Instant>);

/// Acting intervals recorded on this process's monotonic clock.
#[derive(Clone, Default)]
pub struct Intervals(pub Arc<Mutex<Vec<Interval>>>);

impl Intervals {
    pub fn start(&self, node: &str, term: Term) -> usize {
        self.start_at(node, term, Instant::now())
    }

    /// Starts an interval at `at`: for a leader in another process, the
    /// moment it reported.
    pub fn start_at(&self, node: &str, term: Term, at: Instant) -> usize {
        let mut v = self.0.lock().unwrap();
        v.push((node.to_owned(), term, at, None));
        v.len() - 1
    }

    pub fn end(&self, i: usize) {
        self.end_at(i, Instant::now());
    }

    /// Ends interval `i` at `at`: for a lost leadership, the moment the
    /// library cancelled its token (`Loss::at`), not the later
    /// moment a test task woke up to it.
    pub fn end_at(&self, i: usize, at: Instant) {
        self.0.lock().unwrap()[i].3 = Some(at);
    }

    /// The intervals still open.
    pub fn open(&self) -> Vec<Interval> {
        let v = self.0.lock().unwrap();
        v.iter().filter(|x| x.3.is_none()).cloned().collect()
    }

    /// Asserts that no two intervals overlap and that terms rise with time.
    pub fn assert_disjoint(&self) {
        let mut v = self.0.lock().unwrap().clone();
        v.sort_by_key(|x| x.2);
        for w in v.windows(2) {
            let end = w[0].3.expect("an earlier leadership has ended");
            assert!(
                end <= w[1].2,
                "overlap: {} (term {}) acted until {:?} after {} (term {}) began",
                w[0].0,
                w[0].1,
                end - w[1].2,
                w[1].0,
                w[1].1
            );
            assert!(
                w[0].1 < w[1].1,
                "terms must rise: {:?} then {:?}",
                w[0].1,
                w[1].1
            );
        }
    }
}

/// The `candidate` example, built on first use.
fn candidate_exe() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let path = dir.join("examples").join("candidate");
    if !path.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let st = Command::new(cargo)
            .args(["build", "-p", "pgelect", "--example", "candidate"])
            .status()
            .unwrap();
        assert!(st.success());
    }
    path
}

/// A candidate process and the lines it prints.
pub struct Candidate {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Candidate {
    /// Starts `candidate ARGS…` (see pgelect/examples/candidate.rs).
    pub fn spawn(args: &[&str]) -> Candidate {
        Candidate::spawn_with(args, |_| {})
    }

    /// Starts `candidate ARGS…` and also hands every line, as it is read,
    /// to `on_line` (on the reader thread): for a log that must follow
    /// the process without the test polling it.
    pub fn spawn_with(args: &[&str], mut on_line: impl FnMut(&str) + Send + 'static) -> Candidate {
        let mut child = Command::new(candidate_exe())
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                on_line(&l);
                // Nobody may wait for lines any more; keep reading for
                // `on_line`.
                let _ = tx.send(l);
            }
        });
        Candidate { child, lines }
    }

    /// Waits for a line starting with `prefix`.
    pub fn expect(&self, prefix: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(_) => {}
                Err(e) => panic!("no {prefix:?} line within {within:?}: {e}"),
            }
        }
    }

    /// Waits for the process to exit (after a signal that ends it) and
    /// for its reader to pass on every line it printed.
    pub fn wait_exit(&mut self) {
        let _ = self.child.wait();
        // The reader hands a line to `on_line` before it sends it, and
        // drops the sender at end of file.
        while self.lines.recv().is_ok() {}
    }

    /// The next line printed so far, if any (without waiting).
    pub fn try_line(&self) -> Option<String> {
        self.lines.try_recv().ok()
    }

    pub fn signal(&self, sig: &str) {
        let st = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(st.success());
    }
}

impl Drop for Candidate {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The term in a candidate's `ELECTED <term> …` line.
pub fn term_of(line: &str) -> Term {
    Term::new(line.split_whitespace().nth(1).unwrap().parse().unwrap())
}

/// A database of its own with the pgelect schema, and options for it.
pub async fn migrated(hint: &str) -> (TestDb, ConnectOptions) {
    let db = TestDb::new(hint).await;
    let o = ConnectOptions::from_url(&db.url()).expect("test URL parses");
    pgelect::migrate(&o).await.expect("migrate");
    (db, o)
}

/// What a candidate needs (both backends, blocking and polling standbys,
/// the shared connection; its observer reads the row), written out by hand
/// as the book lists it, so that the privilege tests check the library's
/// list against an independent one. `{r}` is the user.
pub const CANDIDATE: &[&str] = &[
    "GRANT USAGE ON SCHEMA pgelect TO {r}",
    "GRANT SELECT ON pgelect.migrations TO {r}",
    "GRANT SELECT, INSERT, UPDATE ON pgelect.leaders TO {r}",
    "GRANT SELECT, INSERT, UPDATE, DELETE ON pgelect.candidates TO {r}",
    "GRANT EXECUTE ON FUNCTION pgelect.lock_wait_slice(bigint, integer) TO {r}",
    "GRANT EXECUTE ON FUNCTION pgelect.lease_acquire(text[], text[], jsonb[], int8[], text[], int4[], int8, int8[]), pgelect.lease_renew(text[], text[], int8[], int8[], int4[]), pgelect.lease_release(text[], text[], int8[], text[]) TO {r}",
];

/// The options of a test URL.
pub fn options(url: &str) -> ConnectOptions {
    ConnectOptions::from_url(url).expect("test URL parses")
}

/// The options of a test database.
pub fn db_options(db: &TestDb) -> ConnectOptions {
    options(&db.url())
}

/// A fresh database (not migrated), its options and an admin connection.
pub async fn database(hint: &str) -> (TestDb, ConnectOptions, tokio_postgres::Client) {
    let db = TestDb::new(hint).await;
    let options = db_options(&db);
    let admin = db.connect().await;
    (db, options, admin)
}

/// Short session-backend timings for tests: ttl 2 s (deadline 1.6 s),
/// renew every 500 ms, heartbeat 200 ms with a 500 ms timeout (handover
/// delay 1.2 s), lease row read every 200 ms.
pub fn fast_session(o: &ConnectOptions, role: &str, node: &str) -> ElectorBuilder {
    Elector::builder(o.clone(), role)
        .node_id(node)
        .ttl(Duration::from_secs(2))
        .renew_every(Duration::from_millis(500))
        .session(|s| {
            s.heartbeat(Duration::from_millis(200))
                .heartbeat_timeout(Duration::from_millis(500))
        })
        .check_every(Duration::from_millis(200))
}

/// Short lease-backend timings for tests: ttl 2 s (local deadline 1.6 s),
/// renew every 500 ms, statements (with a reconnection: SCRAM in a debug
/// build is slow) bounded by 600 ms, standbys retry and the row is read
/// at least every 200 ms.
pub fn fast_lease(o: &ConnectOptions, role: &str, node: &str) -> ElectorBuilder {
    Elector::builder(o.clone(), role)
        .backend(pgelect::election::Backend::Lease)
        .node_id(node)
        .ttl(Duration::from_secs(2))
        .renew_every(Duration::from_millis(500))
        .lease(|l| {
            l.statement_timeout(Duration::from_millis(600))
                .retry_every(Duration::from_millis(200))
        })
        .check_every(Duration::from_millis(200))
}

/// The session test timings ([`fast_session`]), standbys polling every
/// 200 ms.
pub fn fast_polling(o: &ConnectOptions, role: &str, node: &str) -> ElectorBuilder {
    fast_session(o, role, node).session(|s| {
        s.standby(pgelect::election::StandbyMode::Polling {
            interval: Duration::from_millis(200),
        })
    })
}

/// The library's log, captured as text (no colour) for assertions.
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<Vec<u8>>>);

impl Log {
    /// Captures `level` and up on this thread while the guard lives.
    pub fn capture(&self, level: tracing::Level) -> tracing::subscriber::DefaultGuard {
        tracing::subscriber::set_default(self.subscriber(level))
    }

    /// Captures `level` and up in the whole process (for a multi-threaded
    /// runtime; each test has its own process under nextest). `None` if a
    /// global subscriber was already set.
    pub fn install_global(level: tracing::Level) -> Option<Log> {
        let log = Log::default();
        tracing::subscriber::set_global_default(log.subscriber(level))
            .ok()
            .map(|()| log)
    }

    fn subscriber(&self, level: tracing::Level) -> impl tracing::Subscriber + Send + Sync {
        let log = self.clone();
        tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_writer(move || log.clone())
            .finish()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// Lines containing `needle`.
    pub fn count(&self, needle: &str) -> usize {
        self.text().lines().filter(|l| l.contains(needle)).count()
    }

    /// Waits (bounded) until the log has a line containing every needle.
    pub async fn wait_for_line(&self, needles: &[&str], within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let text = self.text();
            if let Some(line) = text.lines().find(|l| needles.iter().all(|n| l.contains(n))) {
                return line.to_owned();
            }
            assert!(
                Instant::now() < deadline,
                "no log line with {needles:?} within {within:?}; the log:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl std::io::Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What the server says about `role` and the sessions around it, for a
/// failure message: the role's row (with the lease left on the server's
/// clock), every other session of this database (state, wait, transaction
/// age, query) and every lock that is not granted.
pub async fn server_state(c: &tokio_postgres::Client, role: &str) -> String {
    let mut out = String::new();
    match c
        .query_typed(
            "SELECT coalesce(holder, '-'), term, backend,
                    coalesce((extract(epoch FROM lease_until - now()) * 1000)::int8::text, '-')
               FROM pgelect.leaders WHERE role = $1",
            &[(&role, tokio_postgres::types::Type::TEXT)],
        )
        .await
    {
        Ok(rows) => {
            for r in rows {
                out += &format!(
                    "row: holder {} term {} backend {} lease left {} ms\n",
                    r.get::<_, String>(0),
                    r.get::<_, i64>(1),
                    r.get::<_, String>(2),
                    r.get::<_, String>(3)
                );
            }
        }
        Err(e) => out += &format!("row: {e}\n"),
    }
    match c
        .simple_query(
            "SELECT pid, coalesce(application_name, ''), coalesce(state, ''),
                    coalesce(wait_event_type || ':' || wait_event, ''),
                    coalesce((extract(epoch FROM now() - xact_start) * 1000)::int8::text, '-'),
                    left(coalesce(query, ''), 120)
               FROM pg_stat_activity
              WHERE datname = current_database() AND pid <> pg_backend_pid()
              ORDER BY pid",
        )
        .await
    {
        Ok(msgs) => {
            for m in msgs {
                if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
                    out += &format!(
                        "session {} [{}] {} wait {} xact {} ms: {}\n",
                        r.get(0).unwrap_or(""),
                        r.get(1).unwrap_or(""),
                        r.get(2).unwrap_or(""),
                        r.get(3).unwrap_or(""),
                        r.get(4).unwrap_or(""),
                        r.get(5).unwrap_or("").replace('\n', " ")
                    );
                }
            }
        }
        Err(e) => out += &format!("sessions: {e}\n"),
    }
    match c
        .simple_query(
            "SELECT pid, locktype, mode, coalesce(relation::regclass::text, ''),
                    array_to_string(pg_blocking_pids(pid), ',')
               FROM pg_locks WHERE NOT granted",
        )
        .await
    {
        Ok(msgs) => {
            for m in msgs {
                if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
                    out += &format!(
                        "waiting: pid {} {} {} {} blocked by [{}]\n",
                        r.get(0).unwrap_or(""),
                        r.get(1).unwrap_or(""),
                        r.get(2).unwrap_or(""),
                        r.get(3).unwrap_or(""),
                        r.get(4).unwrap_or("")
                    );
                }
            }
        }
        Err(e) => out += &format!("locks: {e}\n"),
    }
    out
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Transactions committed and rolled back in `c`'s database so far
/// ([`pgelect_testkit::stats::transactions`]).
pub async fn transactions(c: &tokio_postgres::Client) -> i64 {
    pgelect_testkit::stats::transactions(c).await.unwrap()
}

/// Connections to `c`'s database named `app`
/// ([`pgelect_testkit::stats::connections_named`]).
pub async fn connections_named(c: &tokio_postgres::Client, app: &str) -> i64 {
    pgelect_testkit::stats::connections_named(c, app)
        .await
        .unwrap()
}

/// Rounds of "the leader resigns and stands again at once" between two
/// electors: `electors[0]` leads first, `electors[1]` stands by (given
/// `settle` to be ready), and in each round the leader resigns and
/// campaigns again while the other waits. Each new leader's term is above
/// the last; with `holder_via`, the row read through it names the winner.
/// Returns how many rounds the waiting standby won, each round's time from
/// the resignation, the last leadership and the last standby's campaign.
pub async fn resign_rounds(
    electors: &[Arc<Elector>; 2],
    settle: impl std::future::Future<Output = ()>,
    rounds: usize,
    holder_via: Option<(&ConnectOptions, &str)>,
) -> (
    usize,
    Vec<Duration>,
    pgelect::Leadership,
    tokio::task::JoinHandle<pgelect::Leadership>,
) {
    let campaign = |i: usize| {
        let e = Arc::clone(&electors[i]);
        tokio::spawn(async move { e.leadership().await.unwrap() })
    };
    let mut leader = electors[0].leadership().await.unwrap();
    let mut leading = 0;
    let mut standby = campaign(1);
    settle.await;
    let mut handed = 0;
    let mut took = Vec::new();
    for _ in 0..rounds {
        let t0 = Instant::now();
        let term = leader.term();
        leader.resign().await.unwrap();
        let mut again = campaign(leading);
        let (won, next, waiting) = tokio::time::timeout(Duration::from_secs(10), async {
            tokio::select! {
                l = &mut standby => (1 - leading, l.unwrap(), again),
                l = &mut again => (leading, l.unwrap(), standby),
            }
        })
        .await
        .expect("someone leads again after a resignation");
        took.push(t0.elapsed());
        assert!(next.term() > term, "{:?} after {term:?}", next.term());
        if let Some((options, role)) = holder_via {
            let holder = pgelect::admin::current_leader(options, role)
                .await
                .unwrap()
                .expect("a leader")
                .holder;
            assert_eq!(holder, electors[won].node_id());
        }
        if won != leading {
            handed += 1;
        }
        (leader, leading, standby) = (next, won, waiting);
    }
    (handed, took, leader, standby)
}
