//! The transition system: the initial states, the steps possible in a
//! state (time, deliveries, faults, writes, preemptions) and the state
//! each leads to.

use stateright::{Model, Property};

use super::properties;
use super::scenario::{Backend, Standby, F_CRASH, F_PARTITION, F_PAUSE, F_RESIGN, F_TERMINATE};
use super::state::{Cand, ElectionModel, Life, Locks, Msg, Proc, Row, Stage, State, Step};
use crate::election::keeper::Phase;
use crate::loss::LossReason;

impl ElectionModel {
    /// A fault or other outside event: resets the liveness clock.
    pub(super) fn fault(&self, st: &mut State) {
        for u in &mut st.unled {
            *u = 0;
        }
    }

    pub(super) fn tick(&self, st: &mut State, skew: &[i8]) {
        let s = &self.s;
        st.now += 1;
        for (p, k) in skew.iter().enumerate() {
            let pr = &mut st.procs[p];
            pr.local = (pr.local as i64 + 1 + *k as i64) as u32;
            if *k != 0 {
                pr.drift_left -= 1;
            }
        }
        // Wait slices end: those for the roles' locks, then those for the
        // watch keys.
        for watch in [false, true] {
            for r in 0..st.locks.len() {
                let now = st.now;
                let mut ended = Vec::new();
                st.locks[r].get_mut(watch).queue.retain(|&(p, n, end)| {
                    let over = end <= now;
                    if over {
                        ended.push((p, n));
                    }
                    !over
                });
                for (p, n) in ended {
                    // The lock statement ends: a session that holds
                    // another lock was not idle until now.
                    self.touch(st, p, n);
                    let role = r as u8;
                    if !watch {
                        self.reply(st, p, n, Msg::NotGranted { role });
                        continue;
                    }
                    // `queue_slice_sql`: the statement that timed out
                    // looks up the watch key's holder and ends it if its
                    // session has been idle for longer than the TTL, on
                    // the server's clock, whatever this standby's process
                    // is doing (the statement runs on the server). The
                    // goodbye is sent; a cut-off watch does not get it.
                    if let Some((q, m)) = self.idle_watch(st, r) {
                        if (q, m) != (p, n) {
                            st.seen_watch_end = true;
                            self.end_backend(st, q, m, true);
                        }
                    }
                    self.reply(st, p, n, Msg::WatchNotGranted { role });
                }
            }
        }
        // The server's TCP timeouts declare partitioned clients gone.
        let release = s.server_release();
        let gone: Vec<(u8, u8)> = st
            .backends
            .iter()
            .filter(|b| st.procs[b.proc as usize].partitioned && st.now >= b.last_rx + release)
            .map(|b| (b.proc, b.inc))
            .collect();
        for (p, n) in gone {
            self.end_backend(st, p, n, false);
        }
        for p in 0..st.procs.len() {
            self.settle(st, p);
        }
        // Liveness clock.
        let healthy = st
            .procs
            .iter()
            .any(|pr| pr.life == Life::Up && !pr.partitioned);
        for r in 0..s.roles {
            if !healthy || !st.acting(r).is_empty() {
                st.unled[r] = 0;
            } else {
                st.unled[r] = (st.unled[r] + 1).min(s.liveness_bound() + 1);
            }
        }
    }

    pub(super) fn deliverable(&self, st: &State, i: usize) -> bool {
        let e = &st.net[i];
        if !e.to_server && st.procs[e.proc as usize].life == Life::Paused {
            return false;
        }
        // FIFO per connection and direction.
        !st.net[..i].iter().any(|o| {
            o.to_server == e.to_server
                && o.proc == e.proc
                && o.inc == e.inc
                && o.user_conn == e.user_conn
        })
    }
}

impl Model for ElectionModel {
    type State = State;
    type Action = Step;

    fn init_states(&self) -> Vec<State> {
        let s = &self.s;
        let mut st = State {
            tick: s.tick,
            horizon: s.horizon(),
            // A watch preempts at its own statements, an observer by
            // `check_every` after the TTL.
            idle_cap: s.ticks(s.timing.ttl)
                + 1
                + match s.standby {
                    Standby::Watched => 0,
                    _ => s.ticks(s.timing.check_every),
                },
            watch_idle_cap: s.ticks(s.timing.ttl) + 1,
            now: 0,
            procs: (0..s.procs)
                .map(|_| Proc {
                    life: Life::Up,
                    resume_at: 0,
                    local: 0,
                    drift_left: s.drift,
                    partitioned: false,
                    inc: 0,
                    cands: (0..s.roles)
                        .map(|_| Cand {
                            stage: Stage::Idle { at: 0 },
                            writing: false,
                            place: s.first_place(),
                        })
                        .collect(),
                })
                .collect(),
            backends: Vec::new(),
            started: vec![None; s.procs],
            locks: vec![Locks::default(); s.roles],
            rows: vec![Row::default(); s.roles],
            net: Vec::new(),
            faults_left: s.faults,
            writes_left: s.writes,
            unled: vec![0; s.roles],
            last_active: vec![0; s.roles],
            committed: vec![0; s.roles],
            broken: None,
            seen_unclean_takeover: false,
            seen_fence_refusal: false,
            seen_write: false,
            seen_idle_preempt: false,
            seen_watch_handoff: false,
            seen_watch_end: false,
        };
        for p in 0..s.procs {
            self.settle(&mut st, p);
        }
        vec![st]
    }

    fn actions(&self, st: &State, out: &mut Vec<Step>) {
        let s = &self.s;
        let n = st.procs.len();
        // Deliveries.
        for i in 0..st.net.len() {
            if self.deliverable(st, i) {
                out.push(Step::Deliver {
                    index: i,
                    goodbye: true,
                });
                // A watch's preemption that ends a backend: with the
                // goodbye lost too, as a direct standby's observer's.
                let e = &st.net[i];
                if let (true, Msg::Preempt { role }) = (e.to_server, e.msg) {
                    let by = (e.proc, e.inc);
                    if st.backend_alive(e.proc, e.inc)
                        && !st.procs[e.proc as usize].partitioned
                        && self.zombie(st, role as usize, by).is_some()
                    {
                        out.push(Step::Deliver {
                            index: i,
                            goodbye: false,
                        });
                    }
                }
            }
        }
        // Time, unless a message or a preemption is due now.
        let overdue = st.net.iter().any(|e| {
            e.sent_at + s.delay(e.to_server) <= st.now
                && (e.to_server || st.procs[e.proc as usize].life != Life::Paused)
        });
        let preempt_due = (0..s.roles).any(|r| {
            self.preemptable(st, r)
                .is_some_and(|(_, due)| st.now >= due)
        });
        let resume_due = st
            .procs
            .iter()
            .any(|pr| pr.life == Life::Paused && st.now >= pr.resume_at);
        if !overdue && !preempt_due && !resume_due {
            let mut skews: Vec<Vec<i8>> = vec![Vec::new()];
            for p in 0..n {
                let options: &[i8] = if st.procs[p].drift_left > 0 {
                    &[0, -1, 1]
                } else {
                    &[0]
                };
                skews = skews
                    .into_iter()
                    .flat_map(|v| {
                        options.iter().map(move |k| {
                            let mut v = v.clone();
                            v.push(*k);
                            v
                        })
                    })
                    .collect();
            }
            out.extend(skews.into_iter().map(|skew| Step::Tick { skew }));
        }
        for r in 0..s.roles {
            if self.preemptable(st, r).is_some() {
                for goodbye in [true, false] {
                    out.push(Step::Preempt {
                        role: r as u8,
                        goodbye,
                    });
                }
            }
        }
        for p in 0..n {
            let pr = &st.procs[p];
            let proc = p as u8;
            match pr.life {
                Life::Crashed => out.push(Step::Restart { proc }),
                Life::Paused if st.now < pr.resume_at => {}
                Life::Paused => {
                    out.push(Step::Resume {
                        proc,
                        write_first: false,
                    });
                    if st.writes_left > 0
                        && pr.cands.iter().any(|c| {
                            !c.writing
                                && matches!(&c.stage, Stage::Leading { keeper, .. } if keeper.phase() == Phase::Active)
                        })
                    {
                        out.push(Step::Resume {
                            proc,
                            write_first: true,
                        });
                    }
                }
                Life::Up => {
                    if st.writes_left > 0 {
                        for (r, c) in pr.cands.iter().enumerate() {
                            if !c.writing
                                && matches!(&c.stage, Stage::Leading { keeper, .. } if keeper.phase() == Phase::Active)
                            {
                                out.push(Step::Write {
                                    proc,
                                    role: r as u8,
                                });
                            }
                        }
                    }
                }
            }
            if pr.partitioned {
                out.push(Step::Heal { proc });
            }
            if st.faults_left == 0 {
                continue;
            }
            let k = s.kinds;
            if pr.life == Life::Up {
                if k & F_CRASH != 0 {
                    out.push(Step::Crash { proc });
                }
                if k & F_PAUSE != 0 {
                    for &ticks in &s.pauses {
                        out.push(Step::Pause { proc, ticks });
                    }
                }
                for (r, c) in pr.cands.iter().enumerate() {
                    if k & F_RESIGN == 0 {
                        break;
                    }
                    if matches!(&c.stage, Stage::Leading { keeper, .. } if keeper.phase() == Phase::Active)
                    {
                        out.push(Step::Resign {
                            proc,
                            role: r as u8,
                        });
                    }
                }
            }
            if !pr.partitioned && k & F_PARTITION != 0 {
                out.push(Step::Partition { proc });
            }
            let has_backend = match s.backend {
                Backend::Session => st.backend_alive(proc, pr.inc),
                Backend::Lease => st.net.iter().any(|e| e.proc == proc),
            };
            if has_backend && k & F_TERMINATE != 0 {
                for goodbye in [true, false] {
                    out.push(Step::Terminate { proc, goodbye });
                }
            }
        }
    }

    fn next_state(&self, last: &State, step: Step) -> Option<State> {
        let s = &self.s;
        let mut st = last.clone();
        match step {
            Step::Tick { ref skew } => self.tick(&mut st, skew),
            Step::Deliver { index, goodbye } => {
                let e = st.net.remove(index);
                let p = e.proc as usize;
                if st.procs[p].partitioned {
                    // Lost.
                } else if e.to_server {
                    self.serve(&mut st, e, goodbye);
                } else if st.procs[p].life == Life::Up {
                    self.receive(&mut st, e);
                    self.settle(&mut st, p);
                }
            }
            Step::Crash { proc } => {
                st.faults_left -= 1;
                self.fault(&mut st);
                let p = proc as usize;
                st.procs[p].life = Life::Crashed;
                for c in &mut st.procs[p].cands {
                    c.stage = Stage::Down;
                }
                // Its messages in flight towards it are moot; the kernel
                // closes its socket.
                st.net.retain(|e| e.to_server || e.proc != proc);
                if s.backend == Backend::Session {
                    self.send(&mut st, p, true, Msg::Close);
                }
            }
            Step::Restart { proc } => {
                self.fault(&mut st);
                let p = proc as usize;
                st.procs[p].life = Life::Up;
                st.procs[p].inc = st.procs[p].inc.wrapping_add(1);
                let local = st.procs[p].local;
                for c in &mut st.procs[p].cands {
                    c.stage = Stage::Idle { at: local };
                    c.writing = false;
                    c.place = s.first_place();
                }
                self.settle(&mut st, p);
            }
            Step::Pause { proc, ticks } => {
                st.faults_left -= 1;
                self.fault(&mut st);
                st.procs[proc as usize].life = Life::Paused;
                st.procs[proc as usize].resume_at = st.now + ticks;
            }
            Step::Resume { proc, write_first } => {
                self.fault(&mut st);
                let p = proc as usize;
                st.procs[p].life = Life::Up;
                if write_first {
                    st.writes_left -= 1;
                    for r in 0..s.roles {
                        let c = &st.procs[p].cands[r];
                        if let Stage::Leading { keeper, term, .. } = &c.stage {
                            if keeper.phase() == Phase::Active && !c.writing {
                                let term = *term;
                                st.procs[p].cands[r].writing = true;
                                self.send(
                                    &mut st,
                                    p,
                                    true,
                                    Msg::Write {
                                        role: r as u8,
                                        term,
                                    },
                                );
                            }
                        }
                    }
                }
                self.settle(&mut st, p);
            }
            Step::Terminate { proc, goodbye } => {
                st.faults_left -= 1;
                self.fault(&mut st);
                match s.backend {
                    Backend::Session => {
                        let inc = st.procs[proc as usize].inc;
                        self.end_backend(&mut st, proc, inc, goodbye);
                    }
                    Backend::Lease => {
                        // Statements in flight on a pooled connection are
                        // lost; the driver's statement bound handles it.
                        st.net.retain(|e| e.proc != proc || e.user_conn);
                    }
                }
            }
            Step::Partition { proc } => {
                st.faults_left -= 1;
                self.fault(&mut st);
                let now = st.now;
                st.procs[proc as usize].partitioned = true;
                for b in st.backends.iter_mut().filter(|b| b.proc == proc) {
                    // Keepalives were answered until now.
                    b.last_rx = now;
                }
            }
            Step::Heal { proc } => {
                self.fault(&mut st);
                let p = proc as usize;
                st.procs[p].partitioned = false;
                // Backends the client no longer has are reset by its kernel
                // at the first packet.
                let cur = st.procs[p].inc;
                let crashed = st.procs[p].life == Life::Crashed;
                let stale: Vec<(u8, u8)> = st
                    .backends
                    .iter()
                    .filter(|b| b.proc == proc && (crashed || b.inc != cur))
                    .map(|b| (b.proc, b.inc))
                    .collect();
                for (q, n) in stale {
                    self.end_backend(&mut st, q, n, false);
                }
            }
            Step::Resign { proc, role } => {
                st.faults_left -= 1;
                self.fault(&mut st);
                let p = proc as usize;
                let now = s.at(st.procs[p].local);
                if let Stage::Leading { keeper, .. } = &mut st.procs[p].cands[role as usize].stage {
                    keeper.stop_requested(LossReason::Resigned, now);
                }
                self.settle(&mut st, p);
            }
            Step::Write { proc, role } => {
                let p = proc as usize;
                let Stage::Leading { term, .. } = st.procs[p].cands[role as usize].stage else {
                    return None;
                };
                st.writes_left -= 1;
                st.procs[p].cands[role as usize].writing = true;
                self.send(&mut st, p, true, Msg::Write { role, term });
            }
            Step::Preempt { role, goodbye } => {
                let ((p, n), _) = self
                    .preemptable(&st, role as usize)
                    .expect("BUG: a preemption step that is not possible");
                if st.rows[role as usize].holder != Some((p, n)) {
                    st.seen_idle_preempt = true;
                }
                self.end_backend(&mut st, p, n, goodbye);
            }
        }
        Some(st)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        properties::all()
    }

    fn within_boundary(&self, st: &State) -> bool {
        st.rows.iter().all(|r| r.term <= self.s.max_term)
    }

    fn format_action(&self, step: &Step) -> String {
        format!("{step:?}")
    }
}
