//! The candidates' side of a step: answers received, reconnection, the
//! production keeper driven as the driver drives it, and the end of a
//! leadership.

use super::scenario::{Backend, Place, Standby};
use super::state::{ElectionModel, Envelope, Life, Msg, Stage, State};
use crate::election::keeper::{Action, Keeper};
use crate::loss::LossReason;

impl ElectionModel {
    /// The client (an up process) handles a message from the server.
    pub(super) fn receive(&self, st: &mut State, e: Envelope) {
        let p = e.proc as usize;
        if e.inc != st.procs[p].inc {
            return;
        }
        let local = st.procs[p].local;
        let s = &self.s;
        let from_reply = s.breaks.deadline_from_reply;
        match e.msg {
            Msg::Goodbye => {
                for r in 0..s.roles {
                    if let Stage::Leading { keeper, .. } = &mut st.procs[p].cands[r].stage {
                        keeper.connection_lost();
                    }
                }
                self.reconnect(st, p);
            }
            Msg::Granted { role } => {
                let c = &mut st.procs[p].cands[role as usize];
                if matches!(c.stage, Stage::Asking { .. }) {
                    // The wait is over; the next attempt starts afresh.
                    let place = std::mem::replace(&mut c.place, s.first_place());
                    if place == Place::Watch {
                        // The watch lets go of the watch key (and waits
                        // for the answer) before its term transaction.
                        c.stage = Stage::Unwatching { sent: local };
                        self.send(st, p, true, Msg::WatchUnlock { role });
                    } else {
                        c.stage = Stage::Electing { sent: local };
                        self.send(st, p, true, Msg::Elect { role, sent: local });
                    }
                }
            }
            Msg::WatchUnlocked { role } => {
                let c = &mut st.procs[p].cands[role as usize];
                if matches!(c.stage, Stage::Unwatching { .. }) {
                    c.stage = Stage::Electing { sent: local };
                    self.send(st, p, true, Msg::Elect { role, sent: local });
                }
            }
            Msg::NotGranted { role } => {
                let c = &mut st.procs[p].cands[role as usize];
                if matches!(c.stage, Stage::Asking { .. }) {
                    if c.place == Place::Watch {
                        // A slice passed: the watch reads the row. (A
                        // direct standby's own read and squatter check
                        // change nothing on the server and are left out;
                        // its observer is modelled by `preemptable`.)
                        c.stage = Stage::Observing { sent: local };
                        self.send(st, p, true, Msg::Read { role });
                    } else {
                        c.stage = Stage::Idle {
                            at: local + s.poll_every(),
                        };
                    }
                }
            }
            Msg::WatchGranted { role } => {
                let c = &mut st.procs[p].cands[role as usize];
                if matches!(c.stage, Stage::Asking { .. }) && c.place == Place::Queue {
                    c.place = Place::Watch;
                    c.stage = Stage::Idle { at: local };
                }
            }
            Msg::WatchNotGranted { role } => {
                let c = &mut st.procs[p].cands[role as usize];
                if matches!(c.stage, Stage::Asking { .. }) && c.place == Place::Queue {
                    c.stage = Stage::Idle { at: local };
                }
            }
            Msg::Row { role, vacant } => {
                let c = &mut st.procs[p].cands[role as usize];
                if matches!(c.stage, Stage::Observing { .. }) {
                    if vacant {
                        // No live lease: a zombie may hold the lock.
                        c.stage = Stage::Observing { sent: local };
                        self.send(st, p, true, Msg::Preempt { role });
                    } else {
                        c.stage = Stage::Idle { at: local };
                    }
                }
            }
            Msg::Preempted { role } => {
                let c = &mut st.procs[p].cands[role as usize];
                if matches!(c.stage, Stage::Observing { .. }) {
                    c.stage = Stage::Idle { at: local };
                }
            }
            Msg::Busy { role, sent } => {
                let c = &mut st.procs[p].cands[role as usize];
                if matches!(c.stage, Stage::Asking { sent: x } if x == sent) {
                    c.stage = Stage::Idle {
                        at: local + s.ticks(s.timing.retry_every).max(1),
                    };
                }
            }
            Msg::Elected {
                role,
                term,
                unclean,
                sent,
            } => {
                let c = &mut st.procs[p].cands[role as usize];
                let expected = match c.stage {
                    Stage::Electing { sent: x } | Stage::Asking { sent: x } => x == sent,
                    _ => false,
                };
                if !expected {
                    return;
                }
                let (sent_at, now) = match (s.backend, from_reply) {
                    (_, true) => (s.at(local), s.at(local)),
                    (Backend::Session, false) => (s.at(sent), s.at(local)),
                    // As the lease backend does: both from the send.
                    (Backend::Lease, false) => (s.at(sent), s.at(sent)),
                };
                if unclean {
                    st.seen_unclean_takeover = true;
                }
                c.stage = Stage::Leading {
                    keeper: Box::new(Keeper::new(s.timing, s.liveness(), sent_at, now, unclean)),
                    term,
                    renewing: None,
                };
            }
            Msg::Renewed { role, sent } => {
                if let Stage::Leading {
                    keeper, renewing, ..
                } = &mut st.procs[p].cands[role as usize].stage
                {
                    if s.backend == Backend::Lease && *renewing != Some(sent) {
                        return;
                    }
                    *renewing = None;
                    if from_reply {
                        keeper.renewed(s.at(local), s.at(local));
                    } else {
                        keeper.renewed(s.at(sent), s.at(local));
                    }
                }
                // A shared connection: the answer shows the session alive
                // to the other roles' keepers on it, whose own statements
                // may still be waiting (`Keeper::alive_at`, as the driver
                // does with the session's answers).
                if s.backend == Backend::Session {
                    let at = if from_reply { s.at(local) } else { s.at(sent) };
                    for (r, c) in st.procs[p].cands.iter_mut().enumerate() {
                        if r == role as usize {
                            continue;
                        }
                        if let Stage::Leading { keeper, .. } = &mut c.stage {
                            keeper.alive_at(at);
                        }
                    }
                }
            }
            Msg::NotOurs { role, sent } => {
                if let Stage::Leading {
                    keeper, renewing, ..
                } = &mut st.procs[p].cands[role as usize].stage
                {
                    if s.backend == Backend::Lease && *renewing != Some(sent) {
                        return;
                    }
                    *renewing = None;
                    keeper.preempted();
                }
            }
            Msg::Alive { role } => {
                if let Stage::Leading { keeper, .. } = &mut st.procs[p].cands[role as usize].stage {
                    keeper.heartbeat_ok(s.at(local));
                }
            }
            _ => unreachable!("BUG: a client got {:?}", e.msg),
        }
    }

    /// The process gives up its connection and opens a new one; every
    /// role on it stands again (a keeper told of the loss first ends).
    pub(super) fn reconnect(&self, st: &mut State, p: usize) {
        let s = &self.s;
        if s.backend == Backend::Session {
            let old = st.procs[p].inc;
            // The kernel closes the old socket (lost if partitioned).
            self.send(st, p, true, Msg::Close);
            st.procs[p].inc = old.wrapping_add(1);
        }
        let local = st.procs[p].local;
        for r in 0..s.roles {
            let c = &mut st.procs[p].cands[r];
            if let Stage::Leading { keeper, .. } = &mut c.stage {
                // Tell the keeper, then let `settle` see the loss.
                keeper.connection_lost();
                continue;
            }
            c.stage = Stage::Idle { at: local };
            c.place = s.first_place();
        }
    }

    /// Runs an up process's drivers until nothing is due at its local
    /// time: client-side statement bounds, the keepers' actions, the
    /// standbys' next attempts.
    pub(super) fn settle(&self, st: &mut State, p: usize) {
        let s = &self.s;
        if st.procs[p].life != Life::Up {
            return;
        }
        let local = st.procs[p].local;
        let now = s.at(local);
        let mut reconnect = false;
        for r in 0..s.roles {
            let role = r as u8;
            loop {
                let stage = st.procs[p].cands[r].stage.clone();
                match stage {
                    Stage::Down => break,
                    Stage::Idle { at } => {
                        if local < at {
                            break;
                        }
                        let place = st.procs[p].cands[r].place;
                        let msg = match (s.backend, s.standby, place) {
                            (Backend::Lease, _, _) => Msg::Take { role, sent: local },
                            (Backend::Session, Standby::Polling(_), _) => Msg::Try { role },
                            (Backend::Session, _, Place::Queue) => Msg::WatchLock { role },
                            (Backend::Session, _, Place::Watch) => Msg::Lock {
                                role,
                                slice: s.watch_slice(),
                            },
                            (Backend::Session, _, Place::Direct) => Msg::Lock {
                                role,
                                slice: s.wait_slice(),
                            },
                        };
                        st.procs[p].cands[r].stage = Stage::Asking { sent: local };
                        self.send(st, p, true, msg);
                        break;
                    }
                    Stage::Asking { sent }
                    | Stage::Observing { sent }
                    | Stage::Unwatching { sent }
                    | Stage::Electing { sent } => {
                        let give_up = match s.backend {
                            Backend::Lease => s.ticks(s.timing.heartbeat_timeout).max(1),
                            Backend::Session => s.client_give_up(),
                        };
                        if local >= sent + give_up {
                            match s.backend {
                                Backend::Lease => {
                                    st.procs[p].cands[r].stage = Stage::Idle { at: local + 1 };
                                    continue;
                                }
                                Backend::Session => reconnect = true,
                            }
                        }
                        break;
                    }
                    Stage::Leading { .. } => {
                        let Stage::Leading {
                            keeper,
                            term,
                            renewing,
                        } = &mut st.procs[p].cands[r].stage
                        else {
                            unreachable!()
                        };
                        let term = *term;
                        // The lease driver bounds each statement itself.
                        if let (Backend::Lease, Some(sent)) = (s.backend, *renewing) {
                            if local >= sent + s.ticks(s.timing.heartbeat_timeout).max(1) {
                                *renewing = None;
                                keeper.renew_retry(now, s.tick);
                            }
                        }
                        let mut out = Vec::new();
                        let mut ended = None;
                        while let Some(a) = keeper.poll(now) {
                            match a {
                                Action::Renew => {
                                    *renewing = Some(local);
                                    out.push(Msg::Renew {
                                        role,
                                        term,
                                        sent: local,
                                    });
                                }
                                Action::Heartbeat => out.push(Msg::Heartbeat { role }),
                                Action::Activate => {
                                    if term <= st.last_active[r] && st.broken.is_none() {
                                        st.broken = Some(format!(
                                            "(c) role {r} activated term {term} after term {}",
                                            st.last_active[r]
                                        ));
                                    }
                                    st.last_active[r] = st.last_active[r].max(term);
                                }
                                Action::Lose { reason, kill } => {
                                    ended = Some((reason, kill));
                                    break;
                                }
                            }
                        }
                        for m in out {
                            self.send(st, p, true, m);
                        }
                        if let Some((reason, kill)) = ended {
                            self.end_leadership(st, p, r, term, reason, kill, &mut reconnect);
                        }
                        break;
                    }
                }
            }
        }
        if reconnect {
            self.reconnect(st, p);
            // The keepers told of the loss end now; standbys ask again.
            self.settle(st, p);
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn end_leadership(
        &self,
        st: &mut State,
        p: usize,
        r: usize,
        term: u32,
        reason: LossReason,
        kill: bool,
        reconnect: &mut bool,
    ) {
        let s = &self.s;
        let role = r as u8;
        let local = st.procs[p].local;
        st.procs[p].cands[r].stage = Stage::Idle { at: local };
        st.procs[p].cands[r].place = s.first_place();
        match s.backend {
            Backend::Lease => {
                // After a deadline loss (or a resignation) the user's
                // duties stopped: `resign` releases the lease if still ours.
                if !kill || reason == LossReason::Deadline {
                    self.send(st, p, true, Msg::Release { role, term });
                }
                st.procs[p].cands[r].stage = Stage::Idle { at: local + 1 };
            }
            Backend::Session if !kill => {
                // Duties stopped; clean release on the same connection.
                self.send(st, p, true, Msg::Release { role, term });
            }
            Backend::Session if s.roles > 1 => {
                // A shared connection: only this role's key is let go of.
                self.send(st, p, true, Msg::Unlock { role });
            }
            Backend::Session => *reconnect = true,
        }
    }
}
