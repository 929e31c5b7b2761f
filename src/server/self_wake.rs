//! Wakes a connection's task gives itself while it runs, served in the same poll rather than
//! by the scheduler.
//!
//! hyper serves an HTTP/1 request inside its connection's task: when the handler waits for
//! the request body, the dispatcher reads the next frame from the socket, hands it over, and
//! wakes the handler, that is, the very task being polled. tokio's multi-threaded scheduler
//! takes a wake during a task's own poll for a yield: the task goes to the back of the queue
//! and an idle worker is woken to share the work (a `futex` call and a context switch on the
//! other core, about once a chat request, and sometimes the task moves there, away from the
//! caches that hold its body). [`SelfWake`] notes such a wake instead, and polls the
//! connection again at once, while the task still has budget (`tokio::task::coop`) and at most
//! [`POLLS`] times a turn; after that, or with the budget spent, the wake goes to the scheduler
//! as a yield, as it would have, so a busy connection still takes its turn. A wake that comes
//! between polls (a socket ready, an answer from the upstream) is passed on as it is.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// Polls of the inner future in one poll of the task: the first and the re-polls that wakes
/// during it asked for. One re-poll serves a body frame handed over; a few more, frames that
/// arrive while the handler reads.
pub const POLLS: usize = 4;

/// A future whose wakes during its own poll are served by polling it again in place.
pub struct SelfWake<F> {
    inner: F,
    state: Arc<State>,
    /// A waker of `state`, made once: the inner future's resources see the same waker on
    /// every poll and keep their registration.
    waker: Waker,
}

impl<F: Future + Unpin> SelfWake<F> {
    pub fn new(inner: F) -> SelfWake<F> {
        let state = Arc::new(State {
            phase: AtomicU8::new(IDLE),
            task: AtomicWaker::new(),
        });
        let waker = Waker::from(state.clone());
        SelfWake {
            inner,
            state,
            waker,
        }
    }
}

/// Not being polled: a wake goes to the task.
const IDLE: u8 = 0;
/// Being polled: a wake is noted.
const POLLING: u8 = 1;
/// Woken while being polled: poll it again.
const WOKEN: u8 = 2;

struct State {
    phase: AtomicU8,
    /// The task's own waker, for wakes between polls.
    task: AtomicWaker,
}

impl Wake for State {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        match self
            .phase
            .compare_exchange(POLLING, WOKEN, Ordering::AcqRel, Ordering::Acquire)
        {
            // The poll in progress sees the note when it ends, whichever thread woke.
            Ok(_) => {}
            // Already noted, and not yet seen.
            Err(WOKEN) => {}
            Err(_) => self.task.wake(),
        }
    }
}

impl<F: Future + Unpin> Future for SelfWake<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        this.state.task.register(cx.waker());
        let mut inner_cx = Context::from_waker(&this.waker);
        for _ in 0..POLLS {
            this.state.phase.store(POLLING, Ordering::Release);
            let polled = Pin::new(&mut this.inner).poll(&mut inner_cx);
            let phase = this.state.phase.swap(IDLE, Ordering::AcqRel);
            if polled.is_ready() {
                return polled;
            }
            if phase != WOKEN {
                return Poll::Pending;
            }
            if !tokio::task::coop::has_budget_remaining() {
                break;
            }
        }
        // Woken on every poll, or out of budget: the scheduler decides when it runs next.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A task's waker that counts its wakes.
    #[derive(Default)]
    struct Counting(AtomicUsize);

    impl Wake for Counting {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Wakes itself on its first `self_wakes` polls, keeps the waker of every poll, and is
    /// ready once woken from outside.
    struct Probe {
        polls: usize,
        self_wakes: usize,
        waker: Option<Waker>,
        outside: Arc<std::sync::atomic::AtomicBool>,
    }

    impl Future for Probe {
        type Output = usize;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<usize> {
            self.polls += 1;
            if self.outside.load(Ordering::SeqCst) {
                return Poll::Ready(self.polls);
            }
            self.waker = Some(cx.waker().clone());
            if self.polls <= self.self_wakes {
                cx.waker().wake_by_ref();
            }
            Poll::Pending
        }
    }

    fn probe(self_wakes: usize) -> (SelfWake<Probe>, Arc<std::sync::atomic::AtomicBool>) {
        let outside = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let probe = Probe {
            polls: 0,
            self_wakes,
            waker: None,
            outside: outside.clone(),
        };
        (SelfWake::new(probe), outside)
    }

    #[test]
    fn a_wake_during_the_poll_is_served_in_place_not_by_the_task() {
        let task = Arc::new(Counting::default());
        let waker = Waker::from(task.clone());
        let mut cx = Context::from_waker(&waker);
        let (mut future, _) = probe(1);
        assert!(Pin::new(&mut future).poll(&mut cx).is_pending());
        assert_eq!(future.inner.polls, 2, "polled again in place");
        assert_eq!(task.0.load(Ordering::SeqCst), 0, "the task was not woken");
    }

    #[test]
    fn a_wake_between_polls_reaches_the_task_and_the_next_poll_sees_it() {
        let task = Arc::new(Counting::default());
        let waker = Waker::from(task.clone());
        let mut cx = Context::from_waker(&waker);
        let (mut future, outside) = probe(0);
        assert!(Pin::new(&mut future).poll(&mut cx).is_pending());
        assert_eq!(future.inner.polls, 1);
        // Woken from outside (another thread, as a socket's readiness would be).
        let registered = future
            .inner
            .waker
            .clone()
            .expect("the probe kept its waker");
        outside.store(true, Ordering::SeqCst);
        std::thread::spawn(move || registered.wake())
            .join()
            .expect("the waking thread ran");
        assert_eq!(task.0.load(Ordering::SeqCst), 1, "the task was woken");
        assert_eq!(Pin::new(&mut future).poll(&mut cx), Poll::Ready(2));
    }

    #[test]
    fn a_future_that_always_wakes_itself_yields_to_the_scheduler() {
        let task = Arc::new(Counting::default());
        let waker = Waker::from(task.clone());
        let mut cx = Context::from_waker(&waker);
        let (mut future, _) = probe(usize::MAX);
        assert!(Pin::new(&mut future).poll(&mut cx).is_pending());
        assert_eq!(future.inner.polls, POLLS, "bounded re-polls");
        assert_eq!(task.0.load(Ordering::SeqCst), 1, "then a yield");
        assert!(Pin::new(&mut future).poll(&mut cx).is_pending());
        assert_eq!(future.inner.polls, 2 * POLLS);
        assert_eq!(task.0.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn out_of_budget_it_yields_at_once() {
        // Spend the task's budget the way a busy resource does.
        while tokio::task::coop::has_budget_remaining() {
            tokio::task::coop::consume_budget().await;
        }
        let task = Arc::new(Counting::default());
        let waker = Waker::from(task.clone());
        let mut cx = Context::from_waker(&waker);
        let (mut future, _) = probe(usize::MAX);
        assert!(Pin::new(&mut future).poll(&mut cx).is_pending());
        assert_eq!(future.inner.polls, 1);
        assert_eq!(task.0.load(Ordering::SeqCst), 1);
    }
}
