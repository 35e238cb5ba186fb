//! Augmented training views: random flips and crops of the cached pixels, run through the frozen
//! part of the backbone for every batch (augmented views are not cached).

use indicatif::ProgressBar;
use kestrel_models::Engine;
use kestrel_models::engine::EngineOpts;
use rand::{Rng, rngs::StdRng};

use super::{FitParams, TrainError, TrainingData};
use crate::data::cache::features::{frozen_opts, run_frozen};

/// One sample's random augmentation: the crop origin (7/8 of each side) and whether to flip.
/// Drawn for every sample of a global batch on every rank, in batch order, so each rank applies
/// to its part exactly what one worker would.
#[derive(Clone, Copy)]
struct AugDraw {
    crop: Option<(u32, u32)>,
    flip: bool,
}

fn draw_augment(hw: [u32; 2], flip: bool, crop: bool, rng: &mut StdRng) -> AugDraw {
    let [h, w] = hw;
    let crop = crop.then(|| {
        let (cw, ch) = (w * 7 / 8, h * 7 / 8);
        (rng.random_range(0..=w - cw), rng.random_range(0..=h - ch))
    });
    AugDraw {
        crop,
        flip: flip && rng.random_bool(0.5),
    }
}

/// Augmentation of cached pixels (random horizontal flip; random crop of 7/8 of each side resized back).
fn augment(pixels: &[u8], hw: [u32; 2], d: AugDraw) -> Vec<u8> {
    let [h, w] = hw;
    let mut img = image::RgbImage::from_raw(w, h, pixels.to_vec()).expect("cached pixels");
    if let Some((x0, y0)) = d.crop {
        let (cw, ch) = (w * 7 / 8, h * 7 / 8);
        let c = image::imageops::crop_imm(&img, x0, y0, cw, ch).to_image();
        img = image::imageops::resize(&c, w, h, image::imageops::FilterType::Triangle);
    }
    if d.flip {
        image::imageops::flip_horizontal_in_place(&mut img);
    }
    img.into_raw()
}

/// The frozen part's engine and every sample's cached pixels, for augmented views.
pub struct Augmenter {
    pixels: Vec<Vec<u8>>,
    frozen: Box<dyn Engine>,
    hw: [u32; 2],
    flip: bool,
    crop: bool,
}

impl Augmenter {
    /// `None` when the run does not augment.
    pub fn new(
        p: &FitParams,
        pp: &TrainingData,
        run: EngineOpts,
    ) -> Result<Option<Self>, TrainError> {
        if !(p.augment_flip || p.augment_crop) {
            return Ok(None);
        }
        let opts = frozen_opts(&pp.backbone, pp.boundary);
        Ok(Some(Augmenter {
            pixels: pp.prepared.load_pixels()?,
            frozen: pp.backbone.engine(p.engine, &opts, run)?,
            hw: pp.prepared.meta.spec.input_size,
            flip: p.augment_flip,
            crop: p.augment_crop,
        }))
    }

    /// Features of augmented views of `batch[mine]`. The draws are made for the whole global batch
    /// (the same generator state on every rank), so each rank applies to its part exactly what one
    /// worker would.
    pub fn features(
        &self,
        pp: &TrainingData,
        batch: &[usize],
        mine: std::ops::Range<usize>,
        rng: &mut StdRng,
    ) -> Result<Vec<f32>, TrainError> {
        let draws: Vec<AugDraw> = batch
            .iter()
            .map(|_| draw_augment(self.hw, self.flip, self.crop, rng))
            .collect();
        let views: Vec<Vec<u8>> = batch[mine.clone()]
            .iter()
            .zip(&draws[mine])
            .map(|(&i, d)| augment(&self.pixels[i], self.hw, *d))
            .collect();
        let refs: Vec<&[u8]> = views.iter().map(|v| v.as_slice()).collect();
        Ok(run_frozen(
            self.frozen.as_ref(),
            &pp.prepared.meta.spec,
            &refs,
            pp.features.per_sample(),
            &ProgressBar::hidden(),
        )?)
    }
}
