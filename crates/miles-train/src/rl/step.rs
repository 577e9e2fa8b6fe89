//! Step 4: one optimizer step over a part of the batch, through a [`Learner`].

use miles_model::draft::DraftBatch;
use miles_model::moe::RoutingMismatch;
use miles_model::{DeviceModel, Forward, PackedBatch};
use miles_tensor::cpu::AdamW;
use miles_tensor::{Tensor, ops};

use super::actor::aux_coef;
use crate::batch::{self, TrainSample, concat};
use crate::dist::{Dist, GradBuckets};
use crate::loss::{
    LossInput, LossMetrics, LossOutput, PolicyLossConfig, SftLossConfig, policy_loss, sft_loss,
};

/// How one optimizer step runs: its loss, the sampling temperature its logprobs are taken at,
/// the micro-batch size in samples, the learning rate, a test fault (a NaN loss), and the other
/// processes of a run over several.
pub(super) struct StepSpec<'a> {
    pub(super) loss: StepLoss<'a>,
    pub(super) temperature: f32,
    pub(super) micro: usize,
    pub(super) lr: f32,
    pub(super) inject_nan: bool,
    pub(super) dist: Option<&'a Dist>,
}

/// Which loss a step minimizes.
pub(super) enum StepLoss<'a> {
    Policy(&'a PolicyLossConfig),
    Sft(SftLossConfig),
}

impl StepLoss<'_> {
    /// The loss over micro-batch `mb` whose response tokens' logp and entropy are given. A
    /// sample without old logprobs takes these ([`super::prepare::OldLogprobs::InStep`]).
    fn on(&self, mb: &[TrainSample], logp: &[f32], entropy: &[f32]) -> anyhow::Result<LossOutput> {
        let in_step =
            matches!(self, StepLoss::Policy(_)) && mb.iter().all(|s| s.old_logp.is_empty());
        let old = if in_step { logp.to_vec() } else { concat(mb, |s| &s.old_logp) };
        let adv = concat(mb, |s| &s.advantages);
        let mask = concat(mb, |s| &s.loss_mask);
        let lengths: Vec<usize> = mb.iter().map(TrainSample::response_len).collect();
        let refs = concat_all(mb, |s| s.ref_logp.as_deref());
        let cw = concat_all(mb, |s| s.correction_weights.as_deref());
        let cm = concat_all(mb, |s| s.correction_mask.as_deref());
        let input = LossInput {
            logp,
            old_logp: &old,
            ref_logp: refs.as_deref(),
            entropy,
            advantages: &adv,
            loss_mask: &mask,
            response_lengths: &lengths,
            correction_weights: cw.as_deref(),
            correction_mask: cm.as_deref(),
        };
        Ok(match self {
            StepLoss::Policy(c) => policy_loss(c, &input)?,
            StepLoss::Sft(c) => sft_loss(c, &input)?,
        })
    }
}

/// A per-sample optional field over `mb`, when every sample has it.
fn concat_all<T: Copy>(
    mb: &[TrainSample],
    field: impl Fn(&TrainSample) -> Option<&[T]>,
) -> Option<Vec<T>> {
    mb.iter().all(|s| field(s).is_some()).then(|| concat(mb, |s| field(s).unwrap_or_default()))
}

/// What one optimizer step measured.
pub(super) struct StepResult {
    pub(super) loss: f64,
    pub(super) metrics: LossMetrics,
    pub(super) grad_norm: f64,
    /// The load-balancing loss of a mixture of experts (unweighted).
    pub(super) router_aux_loss: Option<f64>,
    pub(super) routing: Option<RoutingMismatch>,
    /// The draft's MTP loss (its mean cross-entropy per kept token, unscaled) and gradient
    /// norm, with `--enable-mtp-training`.
    pub(super) mtp: Option<(f64, f64)>,
    /// The draft's loss after its warm-up steps, on the step that took them.
    pub(super) mtp_warmup: Option<f64>,
}

impl StepResult {
    /// The loss and metrics summed over the ranks: each rank's are its samples' shares of the
    /// whole batch's. One sum of a fixed length, whatever this rank's part held (a rank without
    /// samples has no mixture-of-experts figures; the others' still come through).
    pub(super) fn sum_over(&mut self, d: &Dist) -> anyhow::Result<()> {
        let m = &mut self.metrics;
        let r = self.routing.unwrap_or_default();
        let mut v = [
            self.loss,
            m.pg_loss,
            m.pg_clipfrac,
            m.ppo_kl,
            m.kl_loss,
            m.entropy_loss,
            m.ois,
            m.opsm_clipfrac,
            self.router_aux_loss.unwrap_or(0.0),
            f64::from(u8::from(self.router_aux_loss.is_some())),
            f64::from(u8::from(self.routing.is_some())),
            r.compared as f64,
            r.own_differs as f64,
            r.used_differs as f64,
        ];
        d.sum(&mut v)?;
        let [
            loss,
            pg_loss,
            pg_clipfrac,
            ppo_kl,
            kl_loss,
            entropy_loss,
            ois,
            opsm_clipfrac,
            aux,
            has_aux,
            has_routing,
            compared,
            own_differs,
            used_differs,
        ] = v;
        self.loss = loss;
        [m.pg_loss, m.pg_clipfrac, m.ppo_kl, m.kl_loss, m.entropy_loss, m.ois, m.opsm_clipfrac] =
            [pg_loss, pg_clipfrac, ppo_kl, kl_loss, entropy_loss, ois, opsm_clipfrac];
        self.router_aux_loss = (has_aux > 0.0).then_some(aux);
        self.routing = (has_routing > 0.0).then_some(RoutingMismatch {
            compared: compared as usize,
            own_differs: own_differs as usize,
            used_differs: used_differs as usize,
        });
        Ok(())
    }
}

/// What [`train_step`] did: the step's result, `None` when its loss or gradient was not finite
/// and nothing was applied, and the response logprobs its forwards computed before the update,
/// per sample of the part in order (up to where a non-finite loss stopped it).
pub(super) struct StepOutcome {
    pub(super) applied: Option<StepResult>,
    pub(super) logp: Vec<Vec<f32>>,
}

/// The model a training step updates and its optimizer: the device model (the CPU's or a
/// GPU's), whose weights, gradients and moments stay on its device. Only per-token logp and
/// entropy and their gradients cross this seam.
pub(super) struct Learner<'a> {
    model: &'a mut DeviceModel,
    hyper: AdamW,
    clip_grad: f64,
    /// The gradient sums the step's last backward started.
    sums: Option<GradBuckets>,
    /// The speculative draft trained beside the policy (`--enable-mtp-training`).
    mtp: Option<Mtp<'a>>,
}

/// The draft's part of a step: its MTP loss on the step's responses, from the policy's
/// states of the step's own forward (detached), added with weight `scale`; the draft has its
/// own AdamW state under the step's hyper-parameters (at its own `lr` when set).
pub(super) struct Mtp<'a> {
    pub(super) draft: &'a mut DeviceModel,
    scale: f32,
    lr: Option<f32>,
    /// The step's masked cross-entropy so far (summed), and its kept tokens (all ranks').
    loss: f64,
    tokens: f64,
    /// Supervised steps to take after this step on its micro-batches (`--mtp-warmup-steps`),
    /// whose inputs are kept for them.
    warmup: usize,
    kept: Vec<DraftInputs>,
}

/// A micro-batch as the draft trains on it: shifted by one, the policy's states at its
/// positions (detached), and each position's loss mask.
struct DraftInputs {
    batch: DraftBatch,
    states: Tensor,
    mask: Vec<f32>,
}

impl<'a> Mtp<'a> {
    pub(super) fn new(
        draft: &'a mut DeviceModel,
        scale: f32,
        lr: Option<f32>,
        warmup: usize,
    ) -> Self {
        Mtp { draft, scale, lr, loss: 0.0, tokens: 0.0, warmup, kept: Vec::new() }
    }

    /// The tokens the draft is trained on in `part`: each response's kept tokens from its
    /// second on (miles' MTP loss mask: the response's, shifted by one).
    fn kept_tokens(part: &[TrainSample]) -> f64 {
        let shifted = |s: &TrainSample| s.loss_mask.iter().skip(1).filter(|&&m| m != 0).count();
        part.iter().map(shifted).sum::<usize>() as f64
    }

    /// Adds the draft's gradient for micro-batch `mb` (packed as `batch`), given the policy's
    /// forward over it.
    fn accumulate(
        &mut self,
        policy: &DeviceModel,
        fwd: &Forward,
        batch: &PackedBatch,
        mb: &[TrainSample],
    ) -> anyhow::Result<()> {
        let Some(d) = DraftBatch::of(batch) else { return Ok(()) };
        let states = ops::gather_rows(&policy.head_states(fwd)?, &d.state_rows)?;
        let mask: Vec<f32> = d
            .sequences
            .iter()
            .flat_map(|&s| mb[s].loss_mask[1..].iter().map(|&m| f32::from(m)))
            .collect();
        let inputs = DraftInputs { batch: d, states, mask };
        self.accumulate_inputs(&inputs)?;
        if self.warmup > 0 {
            self.kept.push(inputs);
        }
        Ok(())
    }

    fn accumulate_inputs(&mut self, inputs: &DraftInputs) -> anyhow::Result<()> {
        let DraftInputs { batch, states, mask } = inputs;
        let f = self.draft.forward_draft(&batch.batch, 1.0, states.try_clone()?)?;
        let per_token = -self.scale / self.tokens.max(1.0) as f32;
        let d_logp: Vec<f32> = mask.iter().map(|m| m * per_token).collect();
        self.loss -= f.logp.iter().zip(mask).map(|(lp, m)| f64::from(lp * m)).sum::<f64>();
        self.draft.backward_draft(&f, &batch.batch, &d_logp, &vec![0.0; d_logp.len()])?;
        Ok(())
    }

    /// The warm-up (`--mtp-warmup-steps`): that many more steps of the draft alone on this
    /// step's micro-batches, from the policy's states of this step's forward; the loss
    /// before the last of them. None when there is none to take.
    fn warm_up(
        &mut self,
        hyper: &AdamW,
        clip_grad: f64,
        dist: Option<&Dist>,
    ) -> anyhow::Result<Option<f64>> {
        let kept = std::mem::take(&mut self.kept);
        let mut loss = None;
        for _ in 0..self.warmup {
            self.draft.zero_grads()?;
            self.loss = 0.0;
            for inputs in &kept {
                self.accumulate_inputs(inputs)?;
            }
            loss = Some(self.apply(hyper, clip_grad, dist)?.0);
        }
        Ok(loss)
    }

    /// Sums the draft's gradients and loss over the ranks, then its AdamW step at `lr`: the
    /// loss per kept token and the gradient norm (the step skipped, the loss still reported,
    /// when the gradient is not finite).
    fn apply(
        &mut self,
        hyper: &AdamW,
        clip_grad: f64,
        dist: Option<&Dist>,
    ) -> anyhow::Result<(f64, f64)> {
        if let Some(d) = dist {
            d.finish_grads(d.grad_buckets(self.draft), self.draft)?;
            let mut loss = [self.loss];
            d.sum(&mut loss)?;
            self.loss = loss[0];
        }
        let loss = self.loss / self.tokens.max(1.0);
        let hyper = AdamW { lr: self.lr.unwrap_or(hyper.lr), ..*hyper };
        let norm = self.draft.grad_norm()?;
        if !norm.is_finite() {
            return Ok((loss, norm));
        }
        Ok((loss, self.draft.adamw_step(&hyper, clip_grad)?.0))
    }
}

impl<'a> Learner<'a> {
    /// A step's learner: the gradients start at zero (the draft's too).
    pub(super) fn new(
        model: &'a mut DeviceModel,
        hyper: AdamW,
        clip_grad: f64,
        mut mtp: Option<Mtp<'a>>,
    ) -> anyhow::Result<Self> {
        model.zero_grads()?;
        if let Some(m) = &mut mtp {
            m.draft.zero_grads()?;
        }
        Ok(Learner { model, hyper, clip_grad, sums: None, mtp })
    }

    /// Adds the gradient of the loss whose derivatives these are. `last` (a run over several
    /// processes, the step's last micro-batch) starts summing the gradients over the ranks as
    /// the backward finishes them; [`Learner::reduce_grads`] completes the sums.
    fn backward(
        &mut self,
        f: Forward,
        batch: &PackedBatch,
        d_logp: &[f32],
        d_entropy: &[f32],
        last: Option<&Dist>,
    ) -> anyhow::Result<()> {
        let Some(dist) = last else {
            return Ok(self.model.backward(&f, batch, d_logp, d_entropy)?);
        };
        let mut sums = dist.grad_buckets(self.model);
        let mut failed = None;
        self.model.backward_with(&f, batch, d_logp, d_entropy, &mut |done, grads| {
            // The model's error type carries no anyhow context: keep the first failure aside.
            if failed.is_none()
                && let Err(e) = dist.start_ready(&mut sums, done, grads)
            {
                failed = Some(e);
            }
            Ok(())
        })?;
        self.sums = Some(sums);
        failed.map_or(Ok(()), Err)
    }

    /// Sums the gradients over the ranks of a run over several processes (or finishes the sums
    /// the last backward started).
    fn reduce_grads(&mut self, dist: &Dist) -> anyhow::Result<()> {
        let sums = self.sums.take().unwrap_or_else(|| dist.grad_buckets(self.model));
        dist.finish_grads(sums, self.model)
    }

    /// Clips and applies the summed gradients at `lr`; the norm before clipping.
    fn apply(&mut self, lr: f32) -> anyhow::Result<f64> {
        Ok(self.model.adamw_step(&AdamW { lr, ..self.hyper }, self.clip_grad)?.0)
    }
}

/// One optimizer step over `part`, accumulated over micro-batches of `micro` sequences, each
/// weighted by its share of the step's denominator so the sum is the loss of the whole part.
/// A sample without old logprobs takes its own from this forward ([`OldLogprobs::InStep`]).
pub(super) fn train_step(
    learner: &mut Learner,
    part: &[TrainSample],
    spec: StepSpec,
) -> anyhow::Result<StepOutcome> {
    let StepSpec { loss, temperature, micro, lr, inject_nan, dist } = spec;
    let per_token = match &loss {
        StepLoss::Policy(c) => c.per_token_loss,
        StepLoss::Sft(c) => c.per_token_loss,
    };
    let weight = |s: &[TrainSample]| -> f64 {
        if per_token {
            s.iter().map(TrainSample::denominator).sum::<usize>() as f64
        } else {
            s.len() as f64
        }
    };
    // Over several processes, the denominator is the whole batch's.
    let whole = match dist {
        Some(d) => {
            let mut w = [weight(part)];
            d.sum(&mut w)?;
            w[0]
        }
        None => weight(part),
    };
    if let Some(mtp) = &mut learner.mtp {
        let mut n = [Mtp::kept_tokens(part)];
        if let Some(d) = dist {
            d.sum(&mut n)?;
        }
        mtp.tokens = n[0];
    }
    let mut finite = true;
    let mut total = StepResult {
        loss: 0.0,
        metrics: LossMetrics::default(),
        grad_norm: 0.0,
        router_aux_loss: None,
        routing: None,
        mtp: None,
        mtp_warmup: None,
    };
    let mut seen = Vec::with_capacity(part.len());
    let micro_batches = part.len().div_ceil(micro.max(1));
    for (i, mb) in part.chunks(micro.max(1)).enumerate() {
        let batch = batch::pack(mb)?;
        let fwd = learner.model.forward(&batch, temperature)?;
        let (logp, entropy) = (&fwd.logp[..], &fwd.entropy[..]);
        let mut at = 0;
        for s in mb {
            seen.push(logp[at..at + s.response_len()].to_vec());
            at += s.response_len();
        }
        let mut out = loss.on(mb, logp, entropy)?;
        if inject_nan {
            out.loss = f64::NAN;
        }
        if !out.loss.is_finite() {
            finite = false;
            // Alone, stop here; with other ranks, take part in their collectives first.
            if dist.is_none() {
                return Ok(StepOutcome { applied: None, logp: seen });
            }
            break;
        }
        if let Some(mtp) = &mut learner.mtp {
            mtp.accumulate(learner.model, &fwd, &batch, mb)?;
        }
        let share = weight(mb) / whole;
        let coef = aux_coef(&learner.model.config);
        let mut fwd = fwd;
        let sparse = &mut fwd.sparse;
        if let Some(aux) = sparse.router_aux_loss {
            out.loss += coef * aux;
            *total.router_aux_loss.get_or_insert(0.0) += share * aux;
        }
        if let Some(m) = &sparse.routing_mismatch {
            total.routing.get_or_insert_default().merge(m);
        }
        let scale = share as f32;
        out.d_logp.iter_mut().for_each(|g| *g *= scale);
        out.d_entropy.iter_mut().for_each(|g| *g *= scale);
        fwd.sparse.aux_weight = scale;
        let last = dist.filter(|_| i + 1 == micro_batches);
        learner.backward(fwd, &batch, &out.d_logp, &out.d_entropy, last)?;
        total.loss += share * out.loss;
        total.metrics.add_scaled(&out.metrics, share);
    }
    if let Some(d) = dist {
        // One summed gradient (the last backward started its sums; a rank that stopped at a
        // non-finite loss, or had no samples, makes the same ones now), then skipped everywhere
        // if any rank's loss was not finite.
        learner.reduce_grads(d)?;
        let mut bad = [f64::from(u8::from(!finite))];
        d.sum(&mut bad)?;
        if bad[0] > 0.0 {
            return Ok(StepOutcome { applied: None, logp: seen });
        }
        total.sum_over(d)?;
    }
    if !learner.model.grad_norm()?.is_finite() {
        return Ok(StepOutcome { applied: None, logp: seen });
    }
    total.grad_norm = learner.apply(lr)?;
    let (hyper, clip) = (AdamW { lr, ..learner.hyper }, learner.clip_grad);
    if let Some(mtp) = &mut learner.mtp {
        total.mtp = Some(mtp.apply(&hyper, clip, dist)?);
        total.mtp_warmup = mtp.warm_up(&hyper, clip, dist)?;
    }
    Ok(StepOutcome { applied: Some(total), logp: seen })
}
