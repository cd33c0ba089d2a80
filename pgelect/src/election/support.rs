//! Utilities the election backends and the observer share: backoff,
//! transient-error classification, the rate-limited "sleep or wake on a
//! release `NOTIFY`" wait, connecting with backoff, and the detection of a
//! transaction pooler.
//!
//! No election rules live here (those are in `keeper.rs` and `timing.rs`),
//! and no backend's statements.

use std::future::Future;
use std::time::Duration;

use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::conn::{ConnectOptions, DedicatedConnection, Notice};
use crate::error::{Error, Result};

use super::config::random_u64;
use super::watch::{parse_leader_event, LEADER_CHANNEL};
use super::Activity;

/// Exponential backoff with jitter: 100 ms doubling up to 5 s, each delay
/// drawn from `[d/2, d]`.
pub(crate) fn backoff(failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(6);
    let d = Duration::from_millis(100 * (1u64 << exp)).min(Duration::from_secs(5));
    let half = d / 2;
    let jitter = random_u64() % (half.as_millis() as u64 + 1);
    half + Duration::from_millis(jitter)
}

/// Consecutive failures over which a multi-host URL is retried fast
/// ([`retry_backoff`]): about a minute at [`FAST_RETRY_CAP`], longer than
/// an HA manager's switchover or failover (pg_auto_failover's node-death
/// failover takes about 50 s with its default timeouts).
pub(crate) const FAST_RETRIES: u32 = 300;

/// The longest wait between two retries of a multi-host URL during
/// [`FAST_RETRIES`].
pub(crate) const FAST_RETRY_CAP: Duration = Duration::from_millis(250);

/// The wait before retrying to connect (or to campaign) through `options`
/// after `failures` consecutive failures.
///
/// With one host: [`backoff`], growing to 5 s. With several (a multi-host
/// URL, `target_session_attrs=read-write` following the primary of an HA
/// pair), a failure means that no host accepted us right now: the primary
/// went away and a standby is being promoted, which the HA manager does
/// within seconds. Growing the wait toward 5 s would leave the candidate
/// asleep for seconds after the new primary accepts writes, so the first
/// retry goes at once (0-25 ms) and later ones every 125-250 ms for
/// [`FAST_RETRIES`] failures (each retry tries every host: refused
/// connections and standbys' answers cost the servers little), then the
/// usual backoff.
pub(crate) fn retry_backoff(options: &ConnectOptions, failures: u32) -> Duration {
    if options.host_count() < 2 || failures > FAST_RETRIES {
        return backoff(failures);
    }
    if failures <= 1 {
        return Duration::from_millis(random_u64() % 26);
    }
    let exp = failures.saturating_sub(1).min(6);
    let d = Duration::from_millis(100 * (1u64 << exp)).min(FAST_RETRY_CAP);
    let half = d / 2;
    half + Duration::from_millis(random_u64() % (half.as_millis() as u64 + 1))
}

/// True when the server refused a write because it accepts none (SQLSTATE
/// 25006, `read_only_sql_transaction`): a standby, a demoted primary, or one
/// fenced with `default_transaction_read_only`.
pub(crate) fn is_read_only(e: &Error) -> bool {
    match e {
        Error::Database { source, .. } => {
            source.code() == Some(&tokio_postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION)
        }
        _ => false,
    }
}

/// True for failures that a new connection may cure: the server went away,
/// restarts, is overloaded, or our backend was terminated; or it accepts
/// no writes ([`is_read_only`]: after a failover, a new connection with
/// several hosts and `target_session_attrs=read-write` reaches the new
/// primary).
pub(crate) fn is_transient(e: &Error) -> bool {
    if is_read_only(e) {
        return true;
    }
    match e {
        // A database that does not exist (SQLSTATE 3D000) is a wrong name,
        // not an outage: returned, as a refused login is.
        Error::Connect { source, .. } => {
            source.code() != Some(&tokio_postgres::error::SqlState::INVALID_CATALOG_NAME)
        }
        Error::ConnectTimeout { .. } | Error::ConnectionLost { .. } => true,
        Error::Database { source, .. } => {
            source.is_closed()
                || source.as_db_error().is_none()
                || source.code().is_some_and(|c| {
                    let class = &c.code()[..2];
                    matches!(class, "08" | "57" | "53" | "40" | "58")
                })
        }
        _ => false,
    }
}

/// Wake-ups on a notification acted on at once, before [`WAKE_GAP`] applies.
pub(crate) const WAKE_BURST: u32 = 5;

/// The least spacing of notification wake-ups beyond the burst.
pub(crate) const WAKE_GAP: Duration = Duration::from_millis(100);

/// Limits the work notifications can cause a standby or an observer.
///
/// Anyone who can connect may `NOTIFY` on [`LEADER_CHANNEL`]: a standby that
/// tried the lock (or the lease), or an observer that read the row, on every
/// notification would let a flood of them drive its statements. Real
/// wake-ups are rare, so a burst of [`WAKE_BURST`] is acted on at once and
/// further ones are spaced [`WAKE_GAP`] apart (a generic cell rate
/// algorithm): a flood costs at most ten wake-ups per second.
#[derive(Debug, Default)]
pub(crate) struct WakeLimit {
    /// When the next wake-up would be due at the sustained rate.
    due: Option<Instant>,
}

impl WakeLimit {
    /// Reserves a wake-up asked for at `now` and returns when it may
    /// happen: `now`, or later during a flood. Call once per wake-up acted
    /// on (not again while one is reserved).
    pub(crate) fn reserve(&mut self, now: Instant) -> Instant {
        let burst = WAKE_GAP * WAKE_BURST;
        let due = self.due.unwrap_or(now);
        let at = if due > now + burst { due - burst } else { now };
        self.due = Some(due.max(at) + WAKE_GAP);
        at
    }
}

/// How a [`nap`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NapEnd {
    /// Its time was up, or it was cut short by a wanted notification (or
    /// by missed ones, which might have been wanted).
    Awake,
    /// The notification channel closed: nothing will wake it early any more.
    ChannelClosed,
}

/// What wakes a [`nap`] early.
pub(crate) enum WakeOn<'a> {
    /// A release of `role` in `schema` on [`LEADER_CHANNEL`].
    Released { schema: &'a str, role: &'a str },
    /// Any leadership change of `role` in `schema`.
    AnyChange { schema: &'a str, role: &'a str },
}

impl WakeOn<'_> {
    /// Whether `n` is such a notification.
    pub(crate) fn wanted(&self, n: &Notice) -> bool {
        if n.channel != LEADER_CHANNEL {
            return false;
        }
        match *self {
            WakeOn::Released { schema, role } => parse_leader_event(schema, &n.payload)
                .is_some_and(|(e, r)| e == "released" && r == role),
            WakeOn::AnyChange { schema, role } => {
                parse_leader_event(schema, &n.payload).is_some_and(|(_, r)| r == role)
            }
        }
    }
}

/// Sleeps until `until`, or less when a notification `wake` wants arrives
/// (or some were missed): the nap then ends at the next wake-up `limit`
/// allows, plus `spread()` for a wanted notification (standbys that would
/// all fire at once spread out), never later than `until`. Only the first
/// such notification shortens the nap.
///
/// # Cancel safety
/// Cancel safe: it only sleeps and reads notifications; a wake-up reserved
/// in `limit` by a dropped nap is simply spent.
pub(crate) async fn sleep_until_woken(
    until: Instant,
    notices: &mut broadcast::Receiver<Notice>,
    wake: WakeOn<'_>,
    limit: &mut WakeLimit,
    spread: impl Fn() -> Duration,
) -> NapEnd {
    let sleep = tokio::time::sleep_until(until);
    tokio::pin!(sleep);
    let mut woken = false;
    loop {
        tokio::select! {
            _ = &mut sleep => return NapEnd::Awake,
            n = notices.recv() => {
                let extra = match n {
                    Ok(n) if wake.wanted(&n) => spread(),
                    Ok(_) => continue,
                    Err(broadcast::error::RecvError::Lagged(_)) => Duration::ZERO,
                    Err(broadcast::error::RecvError::Closed) => return NapEnd::ChannelClosed,
                };
                if !woken {
                    woken = true;
                    let at = (limit.reserve(Instant::now()) + extra).min(sleep.deadline());
                    sleep.as_mut().reset(at);
                }
            }
        }
    }
}

/// How a candidate that gave its role up of its own accord (a
/// resignation, a release while leading: `stepped_aside` holds when and
/// the term, taken here) lets the others take it first, in either backend:
/// the release woke them, but a resigner that stood again at once would
/// often win the race for the role it just gave up (its connection is open
/// and warm; theirs must be woken). It waits a little over one poll
/// interval of theirs (1.25 × `interval`, at most the TTL) from the
/// release, or less once the row shows a term above the one given up
/// (`term_of`), held or released again since: read at the start and at
/// every announced election of the role (which may be this candidate's own
/// earlier one delivered late, or anyone's forged `NOTIFY`, hence the
/// read). A failed read or a closed channel ends the wait: standing again
/// is what the deadline would do. With no other candidate the role stays
/// vacant that long.
pub(crate) async fn step_aside<F: Future<Output = Result<Option<i64>>>>(
    shared: &super::ElectorState,
    stepped_aside: &std::sync::Mutex<Option<(Instant, i64)>>,
    interval: Duration,
    notices: impl FnOnce() -> broadcast::Receiver<Notice>,
    term_of: impl Fn() -> F,
) {
    let since = stepped_aside
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    let Some((since, given_up)) = since else {
        return;
    };
    let until = since + (interval + interval / 4).min(shared.timing.ttl);
    if until <= Instant::now() {
        return;
    }
    tracing::debug!(wait = ?until - Instant::now(), "standing aside after giving the role up");
    let schema = shared.options.schema_name().as_str();
    // Subscribed now: an election announced before is read from the row.
    let mut notices = notices();
    let taken = || async {
        match term_of().await {
            Ok(term) => term.is_some_and(|term| term > given_up),
            Err(_) => true,
        }
    };
    if taken().await {
        return;
    }
    let deadline = tokio::time::sleep_until(until);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            () = &mut deadline => return,
            n = notices.recv() => match n {
                Ok(n) if n.channel == LEADER_CHANNEL
                    && parse_leader_event(schema, &n.payload)
                        == Some(("elected", shared.role.as_str())) =>
                {
                    if taken().await {
                        return;
                    }
                }
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => return,
            },
        }
    }
}

/// Consecutive failures of a long-lived background connection (an
/// observer, a `LISTEN` connection) and the backoff they call for.
#[derive(Debug, Default)]
pub(crate) struct Reconnect {
    failures: u32,
    /// Whether a connection was ever made: the first failure before one
    /// is a warning (a wrong URL, say a `--listen-url`, would otherwise
    /// only degrade to polling without a word), later ones debug (an
    /// outage the elector reports on its own).
    connected_once: bool,
    warned: bool,
}

impl Reconnect {
    /// The connection worked: the next failure starts the backoff afresh.
    pub(crate) fn succeeded(&mut self) {
        self.failures = 0;
    }

    /// Counts a failure and sleeps its backoff; false if `stop` was
    /// cancelled first.
    pub(crate) async fn back_off(&mut self, stop: &CancellationToken) -> bool {
        self.failures = self.failures.saturating_add(1);
        tokio::select! {
            _ = stop.cancelled() => false,
            _ = tokio::time::sleep(backoff(self.failures)) => true,
        }
    }

    /// Connects to `options`, retrying with backoff until it succeeds;
    /// `None` once `stop` is cancelled. Failures are logged as `what`'s:
    /// the first one before any connection was made as a warning, the
    /// others at debug level.
    pub(crate) async fn connect(
        &mut self,
        options: &ConnectOptions,
        purpose: &str,
        stop: &CancellationToken,
        what: &'static str,
    ) -> Option<DedicatedConnection> {
        loop {
            let conn = tokio::select! {
                _ = stop.cancelled() => return None,
                c = options.connect(purpose) => c,
            };
            match conn {
                Ok(conn) => {
                    self.connected_once = true;
                    return Some(conn);
                }
                Err(e) if !self.connected_once && !self.warned => {
                    self.warned = true;
                    tracing::warn!(error = %e, "{what} cannot connect; retrying with backoff (logged once, then at debug level)");
                }
                Err(e) => tracing::debug!(error = %e, "{what} cannot connect; retrying"),
            }
            self.failures = self.failures.saturating_add(1);
            let wait = retry_backoff(options, self.failures);
            let slept = tokio::select! {
                _ = stop.cancelled() => false,
                _ = tokio::time::sleep(wait) => true,
            };
            if !slept {
                return None;
            }
        }
    }
}

/// A `LISTEN` connection lent out between notifications (see
/// [`listen_for`]): `None` while it is down.
pub(crate) type ParkedConnection = tokio::sync::Mutex<Option<DedicatedConnection>>;

/// Where [`listen_for`] lends its connection out, and what it runs on each
/// new connection first, before its `LISTEN` (what the statements sent on
/// it need: grants checked, plans made).
pub(crate) struct Park<'a> {
    pub(crate) slot: &'a ParkedConnection,
    pub(crate) prepare: &'a dyn Prepare,
}

/// What [`Park`] runs on each new connection before its `LISTEN`.
pub(crate) trait Prepare: Sync {
    fn prepare<'c>(
        &'c self,
        c: &'c DedicatedConnection,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'c>>;
}

/// Keeps a connection to `options` that `LISTEN`s on `channels` (reopened
/// with backoff, never affecting anything but the notices it hands on)
/// until `stop` is cancelled or `heard` returns false. `heard(Some(n))`
/// gets each notification; `heard(None)` says that some may have been
/// missed: once each time the `LISTEN` took effect (one sent before it
/// was not heard) and whenever the connection's notice channel lagged.
/// Failures are logged at debug level.
///
/// With `park`, each new connection is prepared by it, then waits in its
/// slot between notifications once its `LISTEN` took effect (before
/// `heard(None)`), for others to send a statement on it now and then; it
/// is taken back when lost or done.
pub(crate) async fn listen_for(
    options: &ConnectOptions,
    purpose: &str,
    channels: &[&str],
    stop: &CancellationToken,
    park: Option<Park<'_>>,
    mut heard: impl FnMut(Option<Notice>) -> bool,
) {
    let listen: String = channels.iter().map(|c| format!("LISTEN {c};")).collect();
    let mut reconnect = Reconnect::default();
    loop {
        let Some(conn) = reconnect
            .connect(options, purpose, stop, "LISTEN connection")
            .await
        else {
            return;
        };
        let mut rx = conn.notices();
        let closed = conn.closed().clone();
        if let Some(p) = &park {
            p.prepare.prepare(&conn).await;
        }
        let listening = conn.client().batch_execute(&listen).await;
        let mut conn = Some(conn);
        match listening {
            Ok(()) => {
                reconnect.succeeded();
                if let Some(p) = &park {
                    *p.slot.lock().await = conn.take();
                }
                let mut go_on = heard(None);
                while go_on {
                    go_on = tokio::select! {
                        _ = stop.cancelled() => false,
                        _ = closed.cancelled() => break,
                        n = rx.recv() => match n {
                            Ok(n) => heard(Some(n)),
                            Err(broadcast::error::RecvError::Lagged(_)) => heard(None),
                            Err(broadcast::error::RecvError::Closed) => break,
                        },
                    };
                }
                if let Some(p) = &park {
                    // Waits for a statement in flight on it, within that
                    // statement's bound.
                    conn = p.slot.lock().await.take();
                }
                if !go_on {
                    if let Some(c) = conn {
                        c.close().await;
                    }
                    return;
                }
                tracing::debug!("LISTEN connection lost; reconnecting");
            }
            Err(e) => tracing::debug!(error = %e, "LISTEN failed; retrying"),
        }
        if let Some(c) = conn {
            c.kill();
        }
        if !reconnect.back_off(stop).await {
            return;
        }
    }
}

/// Counts itself in one of the elector's [`Activity`] counters (standing
/// standbys, live leaderships) for as long as it lives.
pub(crate) struct Counted<'a> {
    activity: &'a tokio::sync::watch::Sender<Activity>,
    field: fn(&mut Activity) -> &mut usize,
}

impl<'a> Counted<'a> {
    pub(crate) fn new(
        activity: &'a tokio::sync::watch::Sender<Activity>,
        field: fn(&mut Activity) -> &mut usize,
    ) -> Self {
        activity.send_modify(|a| *field(a) += 1);
        Counted { activity, field }
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        let field = self.field;
        self.activity
            .send_modify(|a| *field(a) = field(a).saturating_sub(1));
    }
}

/// Detects a pooler in transaction (or statement) mode between us and the
/// server, where the advisory lock would stay on a pooled backend while our
/// next statements run elsewhere.
///
/// A second client connection opens a transaction and keeps it open, which
/// pins one server backend to it for as long as it lasts. Then:
/// * directly or through a session pool, the lock connection owns its
///   backend for good: the probe never gets that backend, and the lock
///   connection's backend pid never changes;
/// * through a transaction pool, the lock connection's backend is returned
///   to the pool after every statement; the probe's `BEGIN` takes an idle
///   server connection — PgBouncer hands out the most recently used one,
///   which is the lock connection's — or, if it gets another one, the lock
///   connection's next statement may land elsewhere. Either shows.
///
/// The check runs the lock connection's pid query three times around the
/// probe's transaction, so both signs are looked at.
pub(crate) async fn check_not_transaction_pooled(
    options: &ConnectOptions,
    conn: &DedicatedConnection,
) -> Result<()> {
    let s = options.schema_name().as_str();
    let first = backend_pid(conn.client(), s).await?;
    let probe = options.connect("pooler-probe").await?;
    let result = async {
        probe
            .client()
            .batch_execute("BEGIN")
            .await
            .map_err(|e| Error::db("check for a transaction pooler", s, e))?;
        let probe_pid = backend_pid(probe.client(), s).await?;
        let second = backend_pid(conn.client(), s).await?;
        let third = backend_pid(conn.client(), s).await?;
        let _ = probe.client().batch_execute("ROLLBACK").await;
        Ok::<_, Error>((probe_pid, [conn.pid(), first, second, third]))
    }
    .await;
    probe.close().await;
    let (probe_pid, seen) = result?;
    let moved = seen.iter().any(|p| *p != seen[0]);
    if moved || seen.contains(&probe_pid) {
        return Err(Error::Pooler(format!(
            "the session backend needs one server session for its whole life, but {} is reached through a pooler in transaction or statement mode (server backend pids seen on one client connection: {seen:?}; a second client got {probe_pid}): advisory locks and LISTEN would stay on a pooled backend. Use the lease backend, which works through transaction pooling, or connect directly or through a session-mode pool",
            options.target()
        )));
    }
    Ok(())
}

async fn backend_pid(c: &tokio_postgres::Client, schema: &str) -> Result<i32> {
    let what = "check for a transaction pooler";
    c.query_typed_one("SELECT pg_backend_pid()", &[])
        .await
        .and_then(|r| r.try_get::<_, i32>(0))
        .map_err(|e| Error::db(what, schema, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_with_jitter_and_a_cap() {
        for n in 1..40 {
            let d = backoff(n);
            assert!(d <= Duration::from_secs(5), "{d:?}");
            assert!(d >= Duration::from_millis(50), "{d:?}");
        }
        assert!(backoff(1) <= Duration::from_millis(100));
        assert!(backoff(10) >= Duration::from_millis(2500));
    }

    #[test]
    fn a_multi_host_url_is_retried_fast_for_a_while() {
        let one = ConnectOptions::from_url("postgres://u@h1/db").unwrap();
        let two = ConnectOptions::from_url("postgres://u@h1,h2/db?target_session_attrs=read-write")
            .unwrap();
        assert!(retry_backoff(&one, 10) >= Duration::from_millis(2500));
        assert!(retry_backoff(&two, 1) <= Duration::from_millis(25));
        for n in 2..=FAST_RETRIES {
            let d = retry_backoff(&two, n);
            assert!(d <= FAST_RETRY_CAP, "{n}: {d:?}");
            assert!(d >= Duration::from_millis(50), "{n}: {d:?}");
        }
        assert!(retry_backoff(&two, 10) >= FAST_RETRY_CAP / 2);
        // Then the usual backoff: a long outage is not hammered.
        assert!(retry_backoff(&two, FAST_RETRIES + 1) >= Duration::from_millis(2500));
    }

    #[test]
    fn a_flood_of_wake_ups_is_spaced_after_a_burst() {
        let t0 = Instant::now();
        let mut w = WakeLimit::default();
        let at: Vec<Instant> = (0..1000).map(|_| w.reserve(t0)).collect();
        assert!(at[..=WAKE_BURST as usize].iter().all(|a| *a == t0));
        assert_eq!(at[WAKE_BURST as usize + 1], t0 + WAKE_GAP);
        for pair in at[WAKE_BURST as usize..].windows(2) {
            assert_eq!(pair[1] - pair[0], WAKE_GAP);
        }
        // Within one second of a flood: the burst and ten more at most.
        let first_second = at
            .iter()
            .filter(|a| **a < t0 + Duration::from_secs(1))
            .count();
        assert!(
            first_second <= WAKE_BURST as usize + 1 + 10,
            "{first_second}"
        );
        // Quiet again: a lone wake-up is at once.
        let later = t0 + Duration::from_secs(200);
        assert_eq!(w.reserve(later), later);
    }

    fn notice(channel: &str, payload: &str) -> Notice {
        Notice {
            channel: channel.to_owned(),
            payload: payload.to_owned(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_release_of_the_role_cuts_a_nap_short_and_nothing_else_does() {
        let (tx, mut rx) = broadcast::channel(16);
        let mut limit = WakeLimit::default();
        let t0 = Instant::now();
        let until = t0 + Duration::from_secs(10);
        let sender = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            // Other roles, other schemas, other events, other channels.
            tx.send(notice(LEADER_CHANNEL, "pgelect:released:other"))
                .unwrap();
            tx.send(notice(LEADER_CHANNEL, "elsewhere:released:r"))
                .unwrap();
            tx.send(notice(LEADER_CHANNEL, "pgelect:elected:r"))
                .unwrap();
            tx.send(notice("pgelect_resign", "pgelect:r")).unwrap();
            tokio::time::sleep(Duration::from_secs(1)).await;
            tx.send(notice(LEADER_CHANNEL, "pgelect:released:r"))
                .unwrap();
            tx
        });
        let released = WakeOn::Released {
            schema: "pgelect",
            role: "r",
        };
        let end = sleep_until_woken(until, &mut rx, released, &mut limit, || {
            Duration::from_millis(3)
        })
        .await;
        assert_eq!(end, NapEnd::Awake);
        assert_eq!(Instant::now() - t0, Duration::from_millis(2003));
        // Any change wakes an observer; a closed channel ends the nap.
        let tx = sender.await.unwrap();
        let t1 = Instant::now();
        tx.send(notice(LEADER_CHANNEL, "pgelect:elected:r"))
            .unwrap();
        // An observer's nap: woken by any change of the role.
        let mut nap_any = async |rx: &mut broadcast::Receiver<Notice>| {
            let any = WakeOn::AnyChange {
                schema: "pgelect",
                role: "r",
            };
            sleep_until_woken(t1 + Duration::from_secs(10), rx, any, &mut limit, || {
                Duration::ZERO
            })
            .await
        };
        let end = nap_any(&mut rx).await;
        assert_eq!(end, NapEnd::Awake);
        assert_eq!(Instant::now(), t1);
        drop(tx);
        let end = nap_any(&mut rx).await;
        assert_eq!(end, NapEnd::ChannelClosed);
    }

    #[tokio::test(start_paused = true)]
    async fn a_flood_of_releases_wakes_standbys_at_the_limited_rate() {
        let (tx, mut rx) = broadcast::channel(4096);
        let mut limit = WakeLimit::default();
        let t0 = Instant::now();
        for _ in 0..1000 {
            tx.send(notice(LEADER_CHANNEL, "pgelect:released:r"))
                .unwrap();
        }
        let mut naps = 0;
        while Instant::now() < t0 + Duration::from_secs(1) {
            let released = WakeOn::Released {
                schema: "pgelect",
                role: "r",
            };
            let until = Instant::now() + Duration::from_secs(10);
            sleep_until_woken(until, &mut rx, released, &mut limit, || Duration::ZERO).await;
            naps += 1;
        }
        // The burst, then one per gap.
        assert!(naps <= WAKE_BURST as usize + 1 + 10, "{naps}");
    }
}
