//! The scenarios checked by default, and the deep run's.

use std::time::Duration;

use super::scenario::{Backend, Breaks, Scenario, Standby, F_ALL};
use crate::election::timing::{Profile, TimingRequest};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

pub(in super::super) fn base(
    name: &'static str,
    backend: Backend,
    req: TimingRequest,
    tick: Duration,
) -> Scenario {
    let timing = match backend {
        Backend::Session => req.validate(),
        Backend::Lease => req.validate_lease(),
    }
    .expect("BUG: a scenario's timing is valid");
    let mut s = Scenario {
        name,
        backend,
        timing,
        tick,
        standby: Standby::Watched,
        procs: 2,
        roles: 1,
        request_delay: 0,
        reply_delay: 0,
        faults: 2,
        kinds: F_ALL,
        drift: 0,
        pauses: Vec::new(),
        max_term: 3,
        writes: 2,
        breaks: Breaks::default(),
    };
    let t = &s.timing;
    s.pauses = vec![
        1,
        s.ticks(t.handover_delay.max(t.heartbeat + t.heartbeat_timeout)) + 1,
        s.liveness_bound(),
    ];
    s
}

/// The session backend, standard profile, default TTL (15 s), ticks of
/// 500 ms (every timing value is a whole number of them).
pub(in super::super) fn session_default() -> Scenario {
    base(
        "session, standard, ttl 15s",
        Backend::Session,
        TimingRequest::default(),
        ms(500),
    )
}

/// The session backend, standard profile, a short TTL (1.5 s), ticks
/// of 100 ms.
pub(in super::super) fn session_short() -> Scenario {
    base(
        "session, standard, ttl 1.5s",
        Backend::Session,
        TimingRequest {
            ttl: Some(ms(1500)),
            wait_slice: Some(ms(1000)),
            ..Default::default()
        },
        ms(100),
    )
}

/// The session backend, fast profile (20 ms heartbeats answered within
/// 25 ms, handover 70 ms), TTL 500 ms, ticks of 5 ms.
pub(in super::super) fn session_fast() -> Scenario {
    base(
        "session, fast, ttl 500ms",
        Backend::Session,
        TimingRequest {
            profile: Profile::Fast,
            ttl: Some(ms(500)),
            wait_slice: Some(ms(200)),
            ..Default::default()
        },
        ms(5),
    )
}

/// The lease backend, default TTL, ticks of 500 ms.
pub(in super::super) fn lease_default() -> Scenario {
    base(
        "lease, ttl 15s",
        Backend::Lease,
        TimingRequest::default(),
        ms(500),
    )
}

/// The lease backend, a short TTL with slow statements (a statement
/// timeout above the safety margin) and one-way delays up to 200 ms:
/// where measuring the deadline from the reply would matter.
pub(in super::super) fn lease_slow_network() -> Scenario {
    Scenario {
        request_delay: 2,
        reply_delay: 2,
        faults: 1,
        ..base(
            "lease, ttl 1s, margin 100ms, statements up to 300ms",
            Backend::Lease,
            TimingRequest {
                ttl: Some(ms(1000)),
                safety_margin: Some(ms(100)),
                renew_every: Some(ms(300)),
                heartbeat_timeout: Some(ms(300)),
                retry_every: Some(ms(200)),
                ..Default::default()
            },
            ms(100),
        )
    }
}

/// [`lease_slow_network`] with the legs apart: requests reach the
/// server within the tick, answers come up to 300 ms late, and the
/// statement timeout (400 ms) still takes them. The setting in which
/// a deadline counted from the reply overlaps two leaders (see the
/// negative control's test).
pub(in super::super) fn lease_slow_answers() -> Scenario {
    let mut s = lease_slow_network();
    s.name = "lease, ttl 1s, margin 100ms, statements up to 400ms, answers up to 300ms late";
    s.timing.heartbeat_timeout = ms(400);
    s.request_delay = 0;
    s.reply_delay = 3;
    s
}

/// Two roles sharing each process's connection (session backend,
/// polling standbys), short TTL.
pub(in super::super) fn shared_connection() -> Scenario {
    let mut s = base(
        "session, shared connection, 2 roles, ttl 1.5s",
        Backend::Session,
        TimingRequest {
            ttl: Some(ms(1500)),
            ..Default::default()
        },
        ms(100),
    );
    s.roles = 2;
    s.standby = Standby::Polling(2);
    s.faults = 1;
    s.writes = 0;
    s
}
