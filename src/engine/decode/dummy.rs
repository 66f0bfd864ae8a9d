//! The prefill ranks a decode rank does not read from in a room, though the
//! rank mapping names them (dummy TP targets: MLA replicas whose KV another
//! prefill rank sends): each is told at `send_metadata` that nothing is
//! needed from it ([`CtlMsg::DummyMeta`]), so its room concludes with its
//! last chunk rather than at its deadline, and told of an abort. The decode
//! waits for none of them: a dummy that cannot be reached only keeps its
//! own room until its deadline, and its acknowledgements fence nothing.

use super::Decode;
use crate::bootstrap::peer::Target;
use crate::bootstrap::schema::Registration;
use crate::engine::control::CtlMsg;
use crate::engine::link::PrefillLink;
use std::sync::Arc;

impl Decode {
    /// The control links to the dummy targets among `targets`; one that
    /// cannot be dialled is left out with a warning (the room goes on).
    pub(super) fn dummy_links(
        self: &Arc<Self>,
        room: u64,
        targets: &[Target],
        local: &Registration,
    ) -> Vec<Arc<PrefillLink>> {
        targets
            .iter()
            .filter(|t| t.dummy)
            .filter_map(|t| match self.prefill_link(&t.registration, local) {
                Ok(l) => Some(l),
                Err(e) => {
                    log::warn!(
                        "room {room}: cannot tell dummy prefill {} that it sends nothing ({e}); its room ends at its deadline",
                        t.registration.describe()
                    );
                    None
                }
            })
            .collect()
    }

    /// Tells each dummy target of `room` that nothing is needed from it.
    pub(super) fn tell_dummies(
        &self,
        room: u64,
        attempt: u64,
        decode_prefix_len: u64,
        dummies: &[Arc<PrefillLink>],
    ) {
        let m = CtlMsg::DummyMeta {
            room,
            attempt,
            decode_prefix_len,
        };
        for d in dummies {
            if let Err(e) = d.writer.send(&m) {
                log::warn!(
                    "room {room}: telling dummy prefill {} that it sends nothing: {e}; its room ends at its deadline",
                    d.registration.describe()
                );
            }
        }
    }
}
