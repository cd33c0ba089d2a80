//! `Elector` and `Leadership`.

use std::sync::Arc;

use pyo3::prelude::*;
use tokio_util::sync::CancellationToken;

use crate::admin::options;
use crate::call::{spawn, Call, Outcome, Signal, Value};
use crate::errors;
use crate::runtime::{runtime, seconds, Owned};

/// A candidate for one role (the library's `Elector`).
#[pyclass(frozen, module = "pgelect._native")]
pub(crate) struct Elector {
    inner: Owned<Arc<pgelect::Elector>>,
    /// Cancelled by `shutdown()`: ends a campaign in progress and the
    /// duties' signal of `Elector.run`.
    shutdown: CancellationToken,
    schema: String,
}

#[pymethods]
impl Elector {
    #[new]
    #[pyo3(signature = (url, role, *, backend="session", ttl=None, renew_every=None, retry_every=None,
                        handover_delay=None, safety_margin=None, check_every=None, node_id=None,
                        priority=None, profile=None, schema=None, meta=None, connect_timeout=None, listen_url=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        url: &str,
        role: &str,
        backend: &str,
        ttl: Option<f64>,
        renew_every: Option<f64>,
        retry_every: Option<f64>,
        handover_delay: Option<f64>,
        safety_margin: Option<f64>,
        check_every: Option<f64>,
        node_id: Option<&str>,
        priority: Option<i32>,
        profile: Option<&str>,
        schema: Option<&str>,
        meta: Option<&str>,
        connect_timeout: Option<f64>,
        listen_url: Option<&str>,
    ) -> PyResult<Self> {
        let options = options(url, schema, connect_timeout)?;
        let schema = options.schema_name().as_str().to_owned();
        let config = |m: String| errors::to_py(config_error(m));
        let mut b = pgelect::Elector::builder(options, role).backend(match backend {
            "session" => pgelect::election::Backend::Session,
            "lease" => pgelect::election::Backend::Lease,
            other => {
                return Err(config(format!(
                    "backend must be \"session\" or \"lease\", got {other:?}"
                )))
            }
        });
        let profile = match profile {
            None => None,
            Some("standard") => Some(pgelect::election::Profile::Standard),
            Some("fast") => Some(pgelect::election::Profile::Fast),
            Some(other) => {
                return Err(config(format!(
                    "profile must be \"standard\" or \"fast\", got {other:?}"
                )))
            }
        };
        // Options of one backend live in its variant: naming one with the
        // other backend is refused, not ignored.
        let only = |option: &str, owner: &str| {
            config(format!(
                "{option} applies to the {owner} backend only; drop it or choose backend=\"{owner}\""
            ))
        };
        if backend == "session" {
            if retry_every.is_some() {
                return Err(only("retry_every", "lease"));
            }
            if listen_url.is_some() {
                return Err(only("listen_url", "lease"));
            }
            let delay = handover_delay
                .map(|t| seconds("handover_delay", t))
                .transpose()?;
            b = b.session(|mut s| {
                if let Some(p) = profile {
                    s = s.profile(p);
                }
                if let Some(d) = delay {
                    s = s.handover_delay(d);
                }
                s
            });
        } else {
            if profile.is_some() {
                return Err(only("profile", "session"));
            }
            if handover_delay.is_some() {
                return Err(only("handover_delay", "session"));
            }
            let retry = retry_every.map(|t| seconds("retry_every", t)).transpose()?;
            let listen = listen_url
                .map(|u| options_for_listen(u, &schema, connect_timeout))
                .transpose()?;
            b = b.lease(|mut l| {
                if let Some(r) = retry {
                    l = l.retry_every(r);
                }
                if let Some(o) = listen {
                    l = l.listen_via(o);
                }
                l
            });
        }
        if let Some(t) = ttl {
            b = b.ttl(seconds("ttl", t)?);
        }
        if let Some(t) = renew_every {
            b = b.renew_every(seconds("renew_every", t)?);
        }
        if let Some(t) = safety_margin {
            b = b.safety_margin(seconds("safety_margin", t)?);
        }
        if let Some(t) = check_every {
            b = b.check_every(seconds("check_every", t)?);
        }
        if let Some(n) = node_id {
            b = b.node_id(n);
        }
        if let Some(p) = priority {
            b = b.priority(p);
        }
        if let Some(m) = meta {
            let value =
                serde_json::from_str(m).map_err(|e| config(format!("meta must be JSON: {e}")))?;
            b = b.meta(value);
        }
        let _entered = runtime()?.enter();
        let elector = b.build().map_err(errors::to_py)?;
        Ok(Elector {
            inner: Owned::new("Elector", Arc::new(elector)),
            shutdown: CancellationToken::new(),
            schema,
        })
    }

    /// Campaigns until elected; the call's value is a `Leadership`, or
    /// `None` once `shutdown()` was called.
    fn leadership(&self) -> PyResult<Call> {
        let elector = self.inner.with(Arc::clone)?;
        let shutdown = self.shutdown.clone();
        let schema = self.schema.clone();
        spawn(async move {
            if shutdown.is_cancelled() {
                return Ok(Won(None));
            }
            tokio::select! {
                l = elector.leadership() => Ok(Won(Some((l?, schema)))),
                _ = shutdown.cancelled() => Ok(Won(None)),
            }
        })
    }

    /// Ends campaigns in progress (their calls return `None`) and sets the
    /// duties' signals of `Elector.run`. For ever: a new elector campaigns
    /// again.
    fn shutdown(&self) {
        self.shutdown.cancel();
    }

    fn is_shutdown(&self) -> bool {
        self.shutdown.is_cancelled()
    }

    /// Deletes this candidate's registry row.
    fn withdraw(&self) -> PyResult<Call> {
        let elector = self.inner.with(Arc::clone)?;
        spawn(async move {
            elector.withdraw().await?;
            Ok(Value(|py: Python<'_>| Ok(py.None())))
        })
    }

    fn role(&self) -> PyResult<String> {
        self.inner.with(|e| e.role().to_owned())
    }

    fn node_id(&self) -> PyResult<String> {
        self.inner.with(|e| e.node_id().to_owned())
    }

    fn backend(&self) -> PyResult<&'static str> {
        self.inner.with(|e| e.backend().as_str())
    }

    /// The timing in force, every default filled in, as JSON (durations in
    /// milliseconds).
    fn timing_json(&self) -> PyResult<String> {
        self.inner.with(|e| e.timing().to_json().to_string())
    }

    /// Drops the library's elector (its observer connections end).
    fn close(&self) -> PyResult<()> {
        self.shutdown.cancel();
        self.inner.take().map(drop)
    }
}

/// A campaign's result.
struct Won(Option<(pgelect::Leadership, String)>);

impl Outcome for Won {
    fn into_py(self: Box<Self>, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match self.0 {
            None => Ok(py.None()),
            Some((l, schema)) => {
                let context = l.context();
                Ok(Py::new(
                    py,
                    Leadership {
                        inner: Owned::new("Leadership", l),
                        context: Owned::new("Leadership", context),
                        schema,
                    },
                )?
                .into_any())
            }
        }
    }

    /// Elected after the caller gave up: resign at once, cleanly.
    fn discard(self: Box<Self>) {
        if let Some((l, _)) = self.0 {
            tokio::spawn(async move {
                let _ = l.resign().await;
            });
        }
    }
}

/// A leadership (the library's `Leadership`).
#[pyclass(frozen, module = "pgelect._native")]
pub(crate) struct Leadership {
    /// Taken by `resign`.
    inner: Owned<pgelect::Leadership>,
    /// Stays for the term, the loss signal and the fence after `resign`.
    context: Owned<pgelect::election::LeaderContext>,
    schema: String,
}

fn reason_of(context: &pgelect::election::LeaderContext) -> Option<String> {
    context
        .loss()
        .map(|l| l.reason())
        .map(|r| r.as_str().to_owned())
}

#[pymethods]
impl Leadership {
    fn term(&self) -> PyResult<i64> {
        self.context.with(|c| c.term().get())
    }

    fn role(&self) -> PyResult<String> {
        self.context.with(|c| c.role().to_owned())
    }

    fn is_lost(&self) -> PyResult<bool> {
        self.context.with(|c| c.is_lost())
    }

    fn loss_reason(&self) -> PyResult<Option<String>> {
        self.context.with(reason_of)
    }

    /// Set when leadership ends, for any reason.
    fn lost_signal(&self) -> PyResult<Signal> {
        let context = self.context.with(Clone::clone)?;
        Ok(Signal::new(context.token(), move || reason_of(&context)))
    }

    /// Set when leadership ends or `elector` shuts down: the signal the
    /// duties of `Elector.run` watch. Setting it does not end leadership.
    fn duties_signal(&self, elector: &Elector) -> PyResult<Signal> {
        let context = self.context.with(Clone::clone)?;
        let duties = context.token();
        let shutdown = elector.shutdown.clone();
        let watched = duties.clone();
        runtime()?.spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => watched.cancel(),
                _ = watched.cancelled() => {}
            }
        });
        let shutdown = elector.shutdown.clone();
        Ok(Signal::new(duties, move || {
            reason_of(&context).or_else(|| shutdown.is_cancelled().then(|| "shutdown".to_owned()))
        }))
    }

    /// Steps down (the library's `Leadership::resign`); a no-op after a
    /// first call.
    fn resign(&self) -> PyResult<Call> {
        let lead = self.inner.take()?;
        spawn(async move {
            if let Some(l) = lead {
                l.resign().await?;
            }
            Ok(Value(|py: Python<'_>| Ok(py.None())))
        })
    }

    /// The fence statement for psycopg and its parameters:
    /// `(sql, role, term)`. Fails, without a statement, once this
    /// leadership is known lost (as the library's `fence` does).
    fn fence_statement(&self) -> PyResult<(String, String, i64)> {
        let context = self.context.with(Clone::clone)?;
        if let Some(reason) = context.loss().map(|l| l.reason()) {
            return Err(errors::to_py(pgelect::Error::LeadershipLost {
                role: context.role().to_owned(),
                term: context.term().get(),
                reason,
            }));
        }
        // The same statement as the library's `LeaderContext::fence`, in
        // psycopg's placeholders; the schema name was validated.
        Ok((
            format!("SELECT {}.fence(%s::text, %s::int8)", self.schema),
            context.role().to_owned(),
            context.term().get(),
        ))
    }
}

/// The exception for a fence refused by the server (SQLSTATE `PE001` or
/// `PE002`, read by psycopg), with the library's message; `None` for any
/// other SQLSTATE.
#[pyfunction]
pub(crate) fn fence_error(
    py: Python<'_>,
    role: &str,
    sqlstate: Option<&str>,
    message: &str,
) -> Option<Py<PyAny>> {
    let e = match sqlstate? {
        pgelect::schema::SQLSTATE_STALE_TERM => pgelect::Error::StaleTerm {
            role: role.to_owned(),
            message: message.to_owned(),
        },
        pgelect::schema::SQLSTATE_NO_LEADER => pgelect::Error::NoLeader {
            role: role.to_owned(),
            message: message.to_owned(),
        },
        _ => return None,
    };
    Some(errors::to_py_object(py, e))
}

fn options_for_listen(
    url: &str,
    schema: &str,
    connect_timeout: Option<f64>,
) -> PyResult<pgelect::ConnectOptions> {
    options(url, Some(schema), connect_timeout)
}

pub(crate) fn config_error(message: String) -> pgelect::Error {
    pgelect::Error::Config(pgelect::election::ConfigError::Invalid(message))
}
