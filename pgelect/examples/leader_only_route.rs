//! A leader-only route in an axum service: every replica serves, but only
//! the elected one does the work behind `POST /work`; the others answer 503
//! and name the leader (from `Elector::watch`), so that a load balancer or
//! a client retries there.
//!
//! ```sh
//! DATABASE_URL=postgres://app:secret@localhost/app \
//!     cargo run -p pgelect --example leader_only_route -- 127.0.0.1:3000
//! curl -X POST localhost:3000/work
//! ```
//!
//! Run a second replica on another port: its `/work` answers 503 until the
//! first one stops.
//!
//! With `PGELECT_EXAMPLE_ONCE=1` (as `scripts/run-examples.sh` runs it) it
//! first lets another candidate of the role lead, asks its own `/work`
//! (503), has that candidate resign, asks again (200) and exits.

use std::error::Error;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use pgelect::{election::LeaderContext, election::LeaderInfo, ConnectOptions, Elector, Leadership};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

type BoxError = Box<dyn Error + Send + Sync>;

const ROLE: &str = "example-http-leader";

#[derive(Clone)]
struct App {
    /// This replica's leadership while it lasts (set by `campaign`).
    leading: watch::Receiver<Option<LeaderContext>>,
    /// Who leads the role, as the elector sees it.
    leader: watch::Receiver<Option<LeaderInfo>>,
}

async fn work(State(app): State<App>) -> (StatusCode, String) {
    let Some(leader) = app.leading.borrow().clone().filter(|l| !l.is_lost()) else {
        let leader = app.leader.borrow().as_ref().map(|l| l.holder.clone());
        let leader = leader.unwrap_or_else(|| "unknown".into());
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the leader is {leader}"),
        );
    };
    // The work; fence its writes with leader.fence(&tx) (see singleton_scheduler).
    (StatusCode::OK, format!("done, term {}", leader.term()))
}

/// Stands for the role for ever, publishing each leadership while it lasts.
async fn campaign(
    elector: Elector,
    leading: watch::Sender<Option<LeaderContext>>,
) -> pgelect::Result<()> {
    loop {
        let leadership = elector.leadership().await?;
        println!("{} elected, term {}", elector.node_id(), leadership.term());
        leading.send_replace(Some(leadership.context()));
        leadership.lost().await;
        leading.send_replace(None);
        println!("leadership ended: {:?}", leadership.loss_reason());
        leadership.resign().await?; // nothing left to release after a loss
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let once = std::env::var_os("PGELECT_EXAMPLE_ONCE").is_some();
    let addr = std::env::args().nth(1);
    let options = ConnectOptions::from_url(&url)?;
    pgelect::migrate(&options).await?; // idempotent; usually a deploy step

    // The demo: another replica of the service leads first.
    let mut other = None;
    if once {
        other = Some(other_replica(&options).await?);
    }
    let elector = Elector::builder(options, ROLE).build()?;
    let (leading_tx, mut leading) = watch::channel(None);
    let mut app = App {
        leading: leading.clone(),
        leader: elector.watch(),
    };
    tokio::spawn(campaign(elector, leading_tx));

    let router = Router::new().route("/work", post(work));
    let listener = tokio::net::TcpListener::bind(addr.as_deref().unwrap_or("127.0.0.1:0")).await?;
    let addr = listener.local_addr()?;
    println!("listening on http://{addr}");
    let server = axum::serve(listener, router.with_state(app.clone()));
    let Some((_other, other_leadership)) = other else {
        return Ok(server.await?);
    };
    tokio::spawn(async move { server.await });

    let wait = Duration::from_secs(10);
    tokio::time::timeout(wait, app.leader.wait_for(Option::is_some)).await??;
    println!(
        "POST /work while other-replica leads: {}",
        post_work(addr).await?
    );
    other_leadership.resign().await?;
    tokio::time::timeout(wait, leading.wait_for(Option::is_some)).await??;
    println!(
        "POST /work while this replica leads: {}",
        post_work(addr).await?
    );
    Ok(())
}

/// For the demo: another replica of the service, leading.
async fn other_replica(options: &ConnectOptions) -> pgelect::Result<(Elector, Leadership)> {
    let elector = Elector::builder(options.clone(), ROLE)
        .node_id("other-replica")
        .build()?;
    let leadership = elector.leadership().await?;
    Ok((elector, leadership))
}

/// A minimal HTTP/1.1 client for the demo: the status line and the body.
async fn post_work(addr: std::net::SocketAddr) -> Result<String, BoxError> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request =
        "POST /work HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    Ok(format!(
        "{} ({})",
        head.lines().next().unwrap_or_default(),
        body.trim()
    ))
}
