//! Leader election, fencing tokens and advisory locks on the PostgreSQL you
//! already run.
//!
//! pgelect turns a PostgreSQL database into a coordination service: no etcd,
//! ZooKeeper or Consul to operate.
//!
//! * **Locks** ([`lock`]): session advisory locks on a connection pgelect
//!   owns ([`LockSession`], [`LockGuard`](lock::LockGuard) with [`lost()`](lock::LockGuard::lost)),
//!   and transaction locks on *your* transaction ([`xact_lock`](lock::xact_lock);
//!   sqlx behind the `sqlx` feature). One call shape: a key, a
//!   [`LockMode`](lock::LockMode) (shared or exclusive) and a
//!   [`Wait`](lock::Wait) policy (not at all, forever, at most a duration).
//!   Semaphores ([`Semaphore`](lock::Semaphore), [`Permit`](lock::Permit)):
//!   at most N holders at once, waiters served in order.
//! * **Loss** ([`loss`]): one API on every handle that can be lost
//!   (leadership, held partition, lock session, lock guard, permit):
//!   `lost()`, `token()`, `is_lost()` and `loss()` (the
//!   [`LossReason`](loss::LossReason) and when).
//! * **Keys** ([`LockKey`]): from integers, pairs, names (hashed the same way
//!   as SQL `pgelect.key(name)`) and UUIDs.
//! * **Election** ([`election`]): [`Elector`] and the [`Leadership`] handle
//!   with its fencing [`Term`], [`LeaderContext::fence`](election::LeaderContext::fence) for your transactions,
//!   observers ([`Elector::watch`], [`current_leader`](admin::current_leader)) and resign requests
//!   from other processes ([`request_resign`](admin::request_resign)). Two backends
//!   ([`Backend`](election::Backend)): `Session` (advisory lock: fast failover) and `Lease`
//!   (lease row only: safe through PgBouncer in transaction mode). Polling
//!   candidates of many roles can share one connection
//!   ([`SharedConnection`](election::SharedConnection)).
//! * **Partitions** ([`partitions`]): a group of N partitions spread
//!   evenly over the live members of a fleet ([`PartitionGroup`](partitions::PartitionGroup)), each
//!   an ordinary role with its own fencing term; gains and losses as a
//!   stream of events with a token per partition.
//! * **Schema** ([`migrate`]): installs the `pgelect` schema (idempotent,
//!   concurrency-safe).
//! * **Operators** ([`admin`]): every role's leader, term, candidates and
//!   squatters as typed rows ([`admin::AdminClient::status`]), held locks,
//!   forgetting a role, resign requests from other processes
//!   ([`admin::request_resign`]), the current leader read once
//!   ([`admin::current_leader`]) and the grants each database user needs;
//!   the `pgelect` command only presents them.
//!
//! # The book
//!
//! This is the API reference. The guide is a book in `docs/` of the
//! repository (`scripts/docs` builds both into one folder, where these
//! links resolve): [getting started](../../book/getting-started.html),
//! [concepts](../../book/concepts/index.html) (roles, terms and fencing, the
//! two backends, [timing and guarantees](../../book/concepts/timing.html)),
//! the [library guide](../../book/guide/index.html), the
//! [command reference](../../book/reference/index.html),
//! [operations](../../book/operations/index.html) (privileges, TLS,
//! PostgreSQL failover, PgBouncer, troubleshooting),
//! [security](../../book/security.html), the [proof](../../book/proof/index.html)
//! (chaos, model check), [measurements](../../book/measurements.html) and the
//! [design notes](../../book/design.html).
//!
//! # Code map
//!
//! Every module of the crate, by file (a unit test fails when a file or
//! folder under `src/` is missing here). Public modules are marked *pub*.
//!
//! * `lib.rs`: these docs and the front door: the ten names most programs
//!   need, re-exported here only (every other item is reached through the
//!   one module that names it).
//! * `admin/` (*pub* [`admin`]): for operators' tools; `admin/mod.rs` has
//!   the module's docs and re-exports:
//!   * `admin/client.rs`: [`admin::AdminClient`], one connection and every
//!     call an operator's tool makes;
//!   * `admin/status.rs`: the status rows ([`admin::RoleStatus`], …) and
//!     their statement, role names to key names;
//!   * `admin/locks.rs`: held locks ([`admin::HeldLock`]), who holds a key
//!     or a semaphore ([`admin::lock_holders`]), lock session names;
//!   * `admin/forget.rs`: forgetting a role ([`admin::ForgetOutcome`]);
//!   * `admin/leader.rs`: [`admin::current_leader`],
//!     [`admin::request_resign`];
//!   * `admin/grants.rs`: the privileges each kind of database user needs
//!     ([`admin::grant_statements`]), the one list the book, the command
//!     and the tests use.
//! * `conn/` (*pub* [`conn`]): connecting to the server; `conn/mod.rs`
//!   re-exports only:
//!   * `conn/options.rs`: connection settings ([`ConnectOptions`],
//!     [`SslMode`](conn::SslMode));
//!   * `conn/connect.rs`: establishing a connection off the runtime's workers;
//!   * `conn/dedicated.rs`: the dedicated connections pgelect owns;
//!   * `conn/cancel.rs`: cancelling a statement in flight;
//!   * `conn/probe.rs`: the one connection probe (an elector's lock
//!     connection, a shared connection's leaders, a lock session), the
//!     coalesced probe of a shared connection, and the defaults of probes
//!     and lock waits, each defined once;
//!   * `conn/tcp.rs`: [`TcpTimeouts`](conn::TcpTimeouts) (keepalives, user timeout);
//!   * `conn/params.rs`: takes the settings pgelect handles itself (TLS,
//!     `target_session_attrs`) out of a URL or `key=value` string;
//!   * `conn/passfile.rs`: libpq's password file (`PGPASSFILE`, `~/.pgpass`);
//!   * `conn/tls.rs`: TLS with libpq's settings (rustls, no system OpenSSL).
//! * `error.rs`: the one [`Error`] type and its classification (`is_*`).
//! * `key.rs`: [`LockKey`], advisory-lock keys (names hashed as SQL
//!   `pgelect.key(name)` hashes them).
//! * `schema/` (*pub* [`schema`]): the `pgelect` schema.
//!   * `schema/mod.rs`: its versioned, idempotent migrations, the schema
//!     check and the fence's SQLSTATE codes;
//!   * `schema/migrate.rs`: [`migrate`], the front door's one schema
//!     function.
//! * `server.rs`: what each PostgreSQL major version supports (logged once,
//!   never fatal).
//! * `metrics.rs` (*pub* [`metrics`]): metric names, as constants.
//! * `loss.rs` (*pub* [`loss`]): the loss API every losable handle shares
//!   ([`loss::Loss`], [`loss::LossReason`], [`loss::Lost`]).
//! * `lock/` (*pub* [`lock`]): advisory locks.
//!   * `lock/mod.rs`: the module's docs and re-exports;
//!   * `lock/session.rs`: [`LockSession`] and [`LockGuard`](lock::LockGuard), session locks
//!     on a dedicated connection;
//!   * `lock/wait.rs`: [`Wait`](lock::Wait), how long an acquisition may wait;
//!   * `lock/xact.rs`: transaction locks on the caller's tokio-postgres
//!     transaction ([`xact_lock`](lock::xact_lock));
//!   * `lock/sqlx.rs` (*pub*, feature `sqlx`): the same on sqlx;
//!   * `lock/semaphore.rs`: [`Semaphore`](lock::Semaphore) and [`Permit`](lock::Permit), at most N holders;
//!   * `lock/holders.rs`: who holds a key ([`LockHolder`](lock::LockHolder)),
//!     squatters told apart during a wait.
//! * `election/` (*pub* [`election`]): the elector.
//!   * `election/mod.rs`: the module's docs (which backend when) and its
//!     namespace;
//!   * `election/elector.rs`: [`Elector`] and its shared state;
//!   * `election/config.rs`: [`ElectorBuilder`], every default documented,
//!     validated in `build()`, and the backends' options in the backend's
//!     variant ([`BackendOptions`](election::BackendOptions),
//!     [`SessionOptions`](election::SessionOptions),
//!     [`LeaseOptions`](election::LeaseOptions));
//!   * `election/config_error.rs`: [`ConfigError`](election::ConfigError),
//!     the refused configuration as the rule broken and its values, and the
//!     [`Setting`](election::Setting)s it names;
//!   * `election/leadership.rs`: [`Leadership`],
//!     [`LeaderContext`](election::LeaderContext), [`Term`];
//!   * `election/timing.rs`: pure rules: timing defaults, [`Profile`](election::Profile) and
//!     the safety inequalities;
//!   * `election/keeper.rs`: pure rules: the leader's keep-alive state
//!     machine (when to renew, heartbeat, act, stop), no I/O;
//!   * `election/driver.rs`: the one loop that keeps a leadership, for
//!     every backend;
//!   * `election/watchdog.rs`: one thread per process that ends every
//!     leadership whose deadline passed, even when the runtime is held;
//!   * `election/term.rs`: how a new term is computed (the WAL timeline in
//!     the high bits);
//!   * `election/registry.rs`: the candidate registry and the readiness
//!     rules of preferred leaders;
//!   * `election/watch.rs`: observers (the leader's row, change
//!     notifications; a waiting standby's observer runs the session
//!     backend's zombie preemption);
//!   * `election/support.rs`: backoff, transient errors, the rate-limited
//!     wait for a release `NOTIFY`, reconnecting, pooler detection;
//!   * `election/model/` (tests only): the model check of the protocol,
//!     driving the real keeper:
//!     * `election/model/mod.rs`: the model's entry points;
//!     * `election/model/scenario.rs`: what a run sets up;
//!     * `election/model/state.rs`, `election/model/actions.rs`,
//!       `election/model/server.rs`, `election/model/candidate.rs`: the
//!       world and its steps (the candidate drives the real keeper);
//!     * `election/model/properties.rs`: what must hold in every state;
//!     * `election/model/explorer.rs`: the breadth-first search;
//!     * `election/model/scenarios.rs`, `election/model/tests.rs`: the
//!       scenarios CI checks;
//!   * `election/sim.rs` (tests only): a randomized simulation of the
//!     session backend in virtual time;
//!   * `election/backend/`: each backend's SQL and behaviour:
//!     * `election/backend/mod.rs`: the small trait the driver calls;
//!     * `election/backend/session/`: the session backend in one folder,
//!       on a connection that carries roles (one candidate's own, or a
//!       [`SharedConnection`](election::SharedConnection) for many roles):
//!       * `election/backend/session/mod.rs`: the sessions that carry
//!         roles (of one candidate, or shared by many) and their batches;
//!       * `election/backend/session/lock_conn.rs`: the connection one
//!         candidate stands on, a session of its own or a shared one, run
//!         the same way by the campaign and the keep;
//!       * `election/backend/session/sql.rs`: its statements (elect,
//!         renew, poll, preempt, watch-key wait);
//!       * `election/backend/session/campaign.rs`: gaining leadership
//!         (blocking, polling and batched waits, term bump, the one zombie
//!         preemption every waiting standby runs);
//!       * `election/backend/session/keep.rs`: keeping it (renewal,
//!         heartbeat, release) and the batched renewal and heartbeat;
//!     * `election/backend/lease/`: the lease backend in one engine,
//!       [`SharedLease`](election::SharedLease) (a lone candidate is a batch of one):
//!       * `election/backend/lease/mod.rs`: the client;
//!       * `election/backend/lease/sql.rs`: its statements behind one seam
//!         (acquire, renew, release, register);
//!       * `election/backend/lease/campaign.rs`: gaining leadership;
//!       * `election/backend/lease/keep.rs`: keeping it;
//!       * `election/backend/lease/listen.rs`: the `LISTEN` connections;
//!     * `election/backend/batch.rs`: batching utilities (chunks of a
//!       batched statement, a leader's place in a batched renewal);
//!     * `election/backend/claim.rs`: one candidate per role on a shared
//!       client.
//! * `partitions/` (*pub* [`partitions`]): balanced partitions.
//!   * `partitions/mod.rs`: [`PartitionGroup`](partitions::PartitionGroup) and its events;
//!   * `partitions/plan.rs`: the pure rules (who should lead what);
//!   * `partitions/driver.rs`: a member's loop that applies the plan.
//!
//! # Guarantees, in short
//!
//! * At most one process holds a role's lock or lease at a time, on the
//!   database's word.
//! * A leader stops acting (its token is cancelled) when its connection
//!   ends, when a renewal finds another holder, or at its local deadline,
//!   measured on the monotonic clock from the *sending* of its last
//!   successful renewal, whether or not the database can be reached. The
//!   configuration is checked so that this deadline passes before anyone
//!   else can take over ([`ElectorBuilder`] lists the inequalities with
//!   their default numbers).
//! * A process that was paused cannot run timers; writes that must never
//!   overlap go through the fence: a fenced transaction of an old term never
//!   commits after a newer term began.
//!
//! # Quick start
//! ```no_run
//! # async fn f() -> Result<(), pgelect::Error> {
//! let options = pgelect::ConnectOptions::from_url("postgres://app:secret@localhost/app")?;
//! pgelect::migrate(&options).await?;
//! let elector = pgelect::Elector::builder(options, "scheduler").build()?;
//! let leadership = elector.leadership().await?;
//! println!("leading with term {}", leadership.term());
//! leadership.lost().await; // do the work until this fires
//! # Ok(()) }
//! ```

pub mod admin;
pub mod conn;
pub mod election;
mod error;
mod key;
pub mod lock;
pub mod loss;
pub mod metrics;
pub mod partitions;
pub mod schema;
mod server;

// The front door: the ten names most programs need. Everything else lives in
// one module that acts as its namespace, reachable by one path only.
pub use conn::options::ConnectOptions;
pub use election::config::ElectorBuilder;
pub use election::elector::Elector;
pub use election::leadership::{Leadership, Term};
pub use error::{Error, Result};
pub use key::LockKey;
pub use lock::session::LockSession;
pub use schema::migrate::migrate;

/// The README's examples, compiled as doc tests so that they stay true.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// The book's Rust snippets (`docs/src`), compiled as doc tests, one item
/// per chapter that has any; `scripts/check-docs.sh` fails on a chapter
/// with a Rust snippet that is missing here.
#[cfg(doctest)]
pub mod book_doctests {
    #[doc = include_str!("../../docs/src/getting-started.md")]
    pub struct GettingStarted;
    #[doc = include_str!("../../docs/src/concepts/roles-terms-fencing.md")]
    pub struct ConceptsRolesTermsFencing;
    #[doc = include_str!("../../docs/src/guide/elections.md")]
    pub struct GuideElections;
    #[doc = include_str!("../../docs/src/guide/locks.md")]
    pub struct GuideLocks;
    #[doc = include_str!("../../docs/src/guide/many-roles.md")]
    pub struct GuideManyRoles;
    #[doc = include_str!("../../docs/src/guide/partitions.md")]
    pub struct GuidePartitions;
    #[doc = include_str!("../../docs/src/guide/errors.md")]
    pub struct GuideErrors;
}

#[cfg(test)]
mod code_map_tests {
    use std::path::Path;

    /// The `//!` lines of `lib.rs`: the crate docs, code map included.
    fn crate_docs(src: &Path) -> String {
        std::fs::read_to_string(src.join("lib.rs"))
            .expect("BUG: lib.rs is readable")
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix("//!"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Every `.rs` file and folder under `dir`, as paths relative to `src`
    /// with `/` separators (folders end with `/`).
    fn modules(src: &Path, dir: &Path, out: &mut Vec<String>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .expect("BUG: src/ is readable")
            .map(|e| e.expect("BUG: a directory entry").path())
            .collect();
        entries.sort();
        for path in entries {
            let rel = path
                .strip_prefix(src)
                .expect("BUG: under src")
                .to_string_lossy()
                .replace('\\', "/");
            if path.is_dir() {
                out.push(format!("{rel}/"));
                modules(src, &path, out);
            } else if rel.ends_with(".rs") {
                out.push(rel);
            }
        }
    }

    /// Fails naming what in `all` (paths relative to `src`, filtered and
    /// mapped by `name`) `text` does not name in backquotes.
    fn assert_named(text: &str, all: &[String], name: impl Fn(&str) -> Option<String>, in_: &str) {
        let missing: Vec<String> = all
            .iter()
            .filter_map(|m| name(m))
            .filter(|n| !text.contains(&format!("`{n}`")))
            .collect();
        assert!(missing.is_empty(), "name these in {in_}: {missing:?}");
    }

    #[test]
    fn every_top_level_module_and_crate_is_in_the_readme_layout() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let readme = std::fs::read_to_string(root.join("README.md")).expect("BUG: README.md");
        let layout = readme
            .split("## Layout")
            .nth(1)
            .and_then(|rest| rest.split("\n## ").next())
            .expect("the README has a Layout section");
        let mut all = Vec::new();
        modules(&src, &src, &mut all);
        // Top-level files are named by their file name after the first one
        // of their row (`pgelect/src/error.rs`, `key.rs`, ...).
        assert_named(
            layout,
            &all,
            |m| match m.strip_suffix('/') {
                Some(dir) if !dir.contains('/') => Some(format!("pgelect/src/{dir}/")),
                None if !m.contains('/') && m != "lib.rs" && m != "error.rs" => Some(m.to_owned()),
                None if !m.contains('/') => Some(format!("pgelect/src/{m}")),
                _ => None,
            },
            "the README's Layout table",
        );
        for member in [
            "pgelect",
            "pgelect-cli",
            "pgelect-testkit",
            "pgelect-bench",
            "pgelect-py",
        ] {
            assert!(
                layout.contains(&format!("`{member}/`")),
                "name {member}/ in the README's Layout table"
            );
        }
    }

    #[test]
    fn every_election_file_and_folder_is_in_the_election_modules_table() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let docs: String = std::fs::read_to_string(src.join("election/mod.rs"))
            .expect("BUG: election/mod.rs is readable")
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix("//!"))
            .collect::<Vec<_>>()
            .join("\n");
        let mut all = Vec::new();
        modules(&src, &src.join("election"), &mut all);
        assert!(all.len() > 10, "found too few modules: {all:?}");
        assert_named(
            &docs,
            &all,
            |m| m.strip_prefix("election/").map(str::to_owned),
            "the table of pgelect/src/election/mod.rs",
        );
    }

    #[test]
    fn every_module_file_and_folder_is_named_in_the_code_map() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let docs = crate_docs(&src);
        let mut all = Vec::new();
        modules(&src, &src, &mut all);
        assert!(all.len() > 10, "found too few modules: {all:?}");
        let missing: Vec<_> = all
            .iter()
            .filter(|m| !docs.contains(&format!("`{m}`")))
            .collect();
        assert!(
            missing.is_empty(),
            "name these in the code map of pgelect/src/lib.rs: {missing:?}"
        );
    }
}
