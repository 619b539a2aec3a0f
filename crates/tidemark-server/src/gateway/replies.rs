//! The replies queued for one WebSocket connection's writer.
//!
//! Bounded (`ServerConfig::ws_send_queue_max`): a reply that finds the
//! queue full means the client is not reading, and the caller ends the
//! connection as a slow consumer rather than drop a reply. One writer
//! takes them in order; the reader and its request tasks put them in.
//!
//! A `VecDeque` under a lock instead of a tokio `mpsc` channel, for memory
//! (issue 19): the channel allocates its first block of 32 slots and its
//! cache-padded state when it is made, about 1.3 KiB per connection idle
//! or not, while the deque holds a buffer only while replies wait and
//! gives a grown one back once drained ([`REPLIES_KEPT_CAPACITY`]).

use std::collections::VecDeque;
use std::sync::Mutex;

use tokio::sync::Notify;

/// Slots a drained queue keeps for the next replies; a buffer grown past
/// it (a burst) is given back when the queue empties.
pub const REPLIES_KEPT_CAPACITY: usize = 4;

/// Why a reply was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushError {
    /// The queue holds its most replies: the client is not reading.
    Full,
    /// The connection is ending; nothing more is written.
    Closed,
}

#[derive(Debug, Default)]
struct Queue {
    frames: VecDeque<String>,
    closed: bool,
}

impl Queue {
    fn take(&mut self) -> Option<String> {
        let text = self.frames.pop_front();
        if self.frames.is_empty() && self.frames.capacity() > REPLIES_KEPT_CAPACITY {
            self.frames = VecDeque::new();
        }
        text
    }
}

/// A bounded queue of reply frames with one consumer (the writer).
#[derive(Debug)]
pub struct Replies {
    queue: Mutex<Queue>,
    /// Woken when a reply is queued or the queue is closed.
    wake: Notify,
    max: usize,
}

impl Replies {
    pub fn new(max: usize) -> Replies {
        Replies { queue: Mutex::default(), wake: Notify::new(), max }
    }

    /// Queues `text` for the writer.
    pub fn push(&self, text: String) -> Result<(), PushError> {
        {
            let mut q = self.queue.lock().expect("replies lock");
            if q.closed {
                return Err(PushError::Closed);
            }
            if q.frames.len() >= self.max {
                return Err(PushError::Full);
            }
            q.frames.push_back(text);
        }
        self.wake.notify_one();
        Ok(())
    }

    /// The oldest reply waiting, if any (without waiting).
    pub fn pop(&self) -> Option<String> {
        self.queue.lock().expect("replies lock").take()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.lock().expect("replies lock").frames.is_empty()
    }

    /// The oldest reply, waiting for one; `None` once the queue is closed
    /// and every reply was taken. Cancel-safe: nothing is taken until it
    /// returns.
    pub async fn recv(&self) -> Option<String> {
        loop {
            // A push between the check and the wait leaves a permit.
            let woken = self.wake.notified();
            {
                let mut q = self.queue.lock().expect("replies lock");
                if let Some(text) = q.take() {
                    return Some(text);
                }
                if q.closed {
                    return None;
                }
            }
            woken.await;
        }
    }

    /// No more replies will be queued; the writer takes what waits, then
    /// [`Replies::recv`] ends.
    pub fn close(&self) {
        self.queue.lock().expect("replies lock").closed = true;
        self.wake.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn replies_are_bounded_in_order_and_end_after_the_close() {
        let r = Replies::new(3);
        for t in ["a", "b", "c"] {
            r.push(t.into()).unwrap();
        }
        assert_eq!(r.push("d".into()), Err(PushError::Full), "a full queue refuses, never drops");
        assert_eq!(r.recv().await.as_deref(), Some("a"));
        assert_eq!(r.pop().as_deref(), Some("b"));
        r.push("d".into()).unwrap();
        r.close();
        assert_eq!(r.push("e".into()), Err(PushError::Closed));
        assert_eq!(r.recv().await.as_deref(), Some("c"), "what waits is still written after the close");
        assert_eq!(r.recv().await.as_deref(), Some("d"));
        assert_eq!(r.recv().await, None);
        assert!(r.is_empty());
    }

    /// A waiting writer is woken by a push from another task.
    #[tokio::test]
    async fn a_waiting_writer_is_woken() {
        let r = std::sync::Arc::new(Replies::new(8));
        let writer = tokio::spawn({
            let r = r.clone();
            async move { r.recv().await }
        });
        tokio::task::yield_now().await;
        r.push("x".into()).unwrap();
        assert_eq!(writer.await.unwrap().as_deref(), Some("x"));
    }

    /// A burst's grown buffer is given back once the queue drains; an idle
    /// queue holds no more than a few slots.
    #[test]
    fn a_drained_queue_gives_its_grown_buffer_back() {
        let r = Replies::new(256);
        assert_eq!(r.queue.lock().unwrap().frames.capacity(), 0, "nothing allocated before the first reply");
        for i in 0..100 {
            r.push(i.to_string()).unwrap();
        }
        while r.pop().is_some() {}
        assert!(r.queue.lock().unwrap().frames.capacity() <= REPLIES_KEPT_CAPACITY);
        r.push("one".into()).unwrap();
        r.pop();
        assert!(r.queue.lock().unwrap().frames.capacity() <= REPLIES_KEPT_CAPACITY);
    }
}
