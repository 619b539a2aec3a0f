//! Fixed routing of conversations to writers (seed 000 §4.2, issue 14):
//! each conversation belongs to one of [`PARTITIONS`] partitions, and each
//! partition to one owner among the live nodes, chosen by rendezvous
//! (highest-random-weight) hashing, so every node that sees the same live
//! set names the same owner, and a node joining or leaving moves only the
//! partitions it wins or held. Routing is for throughput only: correctness
//! never depends on it (row locks keep `msg_seq` contiguous whoever
//! writes, `(sender, client_msg_id)` keeps each message once).
//!
//! Pure and stable: FNV-1a with a fixed seed and a fixed mix, the same on
//! every node, build and run.

/// Conversation partitions of a cluster. A power of two well above any
/// node count, so partitions spread evenly over a few nodes, and small
/// enough that a node's owned set is a cheap table.
pub const PARTITIONS: u32 = 256;

/// FNV-1a (64-bit) of `bytes`, from `seed`.
fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = seed;
    for b in bytes {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// The stable hash of a conversation id (FNV-1a), which also spreads a
/// node's conversations over its own writers.
pub fn conv_hash(conv: &str) -> u64 {
    fnv1a(FNV_OFFSET, conv.as_bytes())
}

/// The partition of `conv`, in `0..PARTITIONS`.
pub fn partition(conv: &str) -> u32 {
    (conv_hash(conv) % u64::from(PARTITIONS)) as u32
}

/// splitmix64's finaliser: FNV's low bits alone weigh the last byte too
/// much for a fair rendezvous.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The weight of `node` for `partition` in the rendezvous.
fn weight(node: &str, partition: u32) -> u64 {
    mix(fnv1a(fnv1a(FNV_OFFSET, node.as_bytes()), &partition.to_le_bytes()))
}

/// The owner of `partition` among `nodes` (ids of the live nodes, in any
/// order): the node of highest weight, ties (equal weights) going to the
/// smaller id. `None` when no node is live.
pub fn owner<'a>(partition: u32, nodes: &[&'a str]) -> Option<&'a str> {
    nodes.iter().copied().max_by(|a, b| weight(a, partition).cmp(&weight(b, partition)).then_with(|| b.cmp(a)))
}

/// Where a conversation-side write goes on a node that knows `nodes` as
/// live (itself included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route<'a> {
    /// This node owns the conversation, or no owner is known: write here.
    Local,
    /// Forward to this node, the owner.
    Forward(&'a str),
}

/// Routes a write on `conv` from node `me`, which knows the live `nodes`.
pub fn route<'a>(conv: &str, me: &str, nodes: &[&'a str]) -> Route<'a> {
    match owner(partition(conv), nodes) {
        Some(owner) if owner != me => Route::Forward(owner),
        _ => Route::Local,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_are_stable_and_spread() {
        // Fixed values: every node and build computes the same.
        let table = [("", FNV_OFFSET % 256), ("c1", conv_hash("c1") % 256)];
        for (conv, p) in table {
            assert_eq!(u64::from(partition(conv)), p, "{conv:?}");
        }
        assert_eq!(conv_hash("a"), 0xaf63_dc4c_8601_ec8c, "FNV-1a 64 of \"a\"");
        let mut counts = vec![0usize; PARTITIONS as usize];
        for i in 0..25_600 {
            counts[partition(&format!("conv-{i}")) as usize] += 1;
        }
        assert!(counts.iter().all(|&n| (50..=150).contains(&n)), "{counts:?}");
    }

    #[test]
    fn owners_agree_whatever_the_order_and_move_only_what_they_must() {
        let three = ["n-a", "n-b", "n-c"];
        let mut won = [0usize; 3];
        for p in 0..PARTITIONS {
            let o = owner(p, &three).unwrap();
            assert_eq!(Some(o), owner(p, &["n-c", "n-a", "n-b"]), "order of the live set does not matter");
            won[three.iter().position(|n| *n == o).unwrap()] += 1;
            // n-b leaves: only its partitions move, and to a survivor.
            let two = owner(p, &["n-a", "n-c"]).unwrap();
            if o != "n-b" {
                assert_eq!(two, o, "partition {p} stays with {o}");
            }
            // A fourth node takes partitions only for itself.
            let four = owner(p, &["n-a", "n-b", "n-c", "n-d"]).unwrap();
            assert!(four == o || four == "n-d", "partition {p}: {o} -> {four}");
        }
        assert!(won.iter().all(|&n| n > 60), "three nodes share the partitions: {won:?}");
        assert_eq!(owner(0, &[]), None);
        assert_eq!(owner(7, &["solo"]), Some("solo"));
    }

    #[test]
    fn a_write_goes_to_its_owner_or_stays_here() {
        let nodes = ["n-a", "n-b", "n-c"];
        let mut forwarded = 0;
        for i in 0..100 {
            let conv = format!("c{i}");
            let o = owner(partition(&conv), &nodes).unwrap();
            for me in nodes {
                let r = route(&conv, me, &nodes);
                if me == o {
                    assert_eq!(r, Route::Local);
                } else {
                    assert_eq!(r, Route::Forward(o));
                    forwarded += 1;
                }
            }
            // Alone (no other node heard), a node writes everything itself.
            assert_eq!(route(&conv, "n-a", &["n-a"]), Route::Local);
            // Not yet in its own view (never the case in the server): local.
            assert_eq!(route(&conv, "n-z", &[]), Route::Local);
        }
        assert_eq!(forwarded, 200, "two of three nodes forward each conversation");
    }
}
