//! Image preprocessing: one spec, one implementation, shared by trainer and edge.
//!
//! The pipeline is, in order:
//! 1. decode (format guessed from the bytes, with [`ImageLimits`] against decompression bombs);
//! 2. colour conversion to 8-bit RGB: grayscale is replicated to three channels, 16-bit samples are
//!    scaled to 8 bits (`v * 255 / 65535`, rounded, as the `image` crate does), alpha is dropped or
//!    blended over a background colour ([`Alpha`]);
//! 3. resize ([`Resize`]) with the given [`Filter`];
//! 4. crop ([`Crop`]) to `input_size`;
//! 5. `((v * scale) - mean[c]) / std[c]` per channel, laid out `CHW` in [`ChannelOrder`].

use std::io::Cursor;

use image::{DynamicImage, ImageReader, RgbImage, imageops::FilterType};
use serde::{Deserialize, Serialize};

/// How an image becomes a model input tensor. Serialized into artifact manifests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreprocessSpec {
    /// Final tensor height and width.
    pub input_size: [u32; 2],
    pub resize: Resize,
    pub filter: Filter,
    pub crop: Crop,
    pub alpha: Alpha,
    pub channel_order: ChannelOrder,
    /// Multiplier applied to 8-bit sample values before mean/std (usually 1/255).
    pub scale: f32,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resize {
    /// Scale so the shorter side equals this, keeping the aspect ratio (rounded to nearest).
    ShorterSide(u32),
    /// Scale to exactly `[height, width]`, ignoring the aspect ratio.
    Exact([u32; 2]),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Filter {
    Nearest,
    Bilinear,
    Bicubic,
    Lanczos3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Crop {
    /// Centre crop to `input_size` (offsets floor((W - w) / 2), as torchvision rounds).
    Center,
    /// No crop: the resize must already produce `input_size`.
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Alpha {
    /// Ignore the alpha channel (PIL's `convert("RGB")`).
    Drop,
    /// Composite over this RGB background.
    Blend([u8; 3]),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChannelOrder {
    Rgb,
    Bgr,
}

impl PreprocessSpec {
    /// torchvision/ImageNet convention: shorter side 256, centre crop 224, ImageNet mean/std.
    pub fn imagenet() -> Self {
        Self {
            input_size: [224, 224],
            resize: Resize::ShorterSide(256),
            filter: Filter::Bilinear,
            crop: Crop::Center,
            alpha: Alpha::Drop,
            channel_order: ChannelOrder::Rgb,
            scale: 1.0 / 255.0,
            mean: [0.485, 0.456, 0.406],
            std: [0.229, 0.224, 0.225],
        }
    }

    /// TensorFlow "inception" convention used by EfficientNet-Lite: `(x/255 - 0.5) / 0.5`.
    pub fn tf_inception() -> Self {
        Self {
            mean: [0.5; 3],
            std: [0.5; 3],
            ..Self::imagenet()
        }
    }

    /// The spec a timm model's `pretrained_cfg` describes, given as it is or inside a Hugging Face
    /// `config.json` (`{"pretrained_cfg": {...}}`): `input_size` `[3, H, W]`, `interpolation`,
    /// `mean`, `std` and `crop_pct` (default 0.875), resized as timm's eval transform does: the
    /// shorter side to `floor(H / crop_pct)`, then a centre crop to `H x W` (a `crop_mode` other
    /// than `center` is refused). Errors name the key that is missing or wrong.
    pub fn from_timm_config(cfg: &serde_json::Value) -> Result<Self, String> {
        let cfg = cfg.get("pretrained_cfg").unwrap_or(cfg);
        let floats = |key: &str, n: usize| -> Result<Vec<f64>, String> {
            let v = cfg.get(key).ok_or(format!("no `{key}`"))?;
            let list: Option<Vec<f64>> = v
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_f64()).collect());
            match list {
                Some(l) if l.len() == n => Ok(l),
                _ => Err(format!("`{key}` is {v}, expected {n} numbers")),
            }
        };
        let size = floats("input_size", 3)?;
        let (h, w) = (size[1] as u32, size[2] as u32);
        if size[0] != 3.0 || h == 0 || w == 0 {
            return Err(format!("`input_size` {size:?} is not [3, H, W]"));
        }
        let crop_pct = match cfg.get("crop_pct") {
            None | Some(serde_json::Value::Null) => 0.875,
            Some(v) => v
                .as_f64()
                .filter(|p| *p > 0.0 && *p <= 1.0)
                .ok_or(format!("`crop_pct` {v} is not in (0, 1]"))?,
        };
        match cfg.get("crop_mode").and_then(|m| m.as_str()) {
            None | Some("center") => {}
            Some(m) => {
                return Err(format!(
                    "`crop_mode` {m:?}: only centre crops are supported"
                ));
            }
        }
        let filter = match cfg.get("interpolation").and_then(|i| i.as_str()) {
            None | Some("bilinear") => Filter::Bilinear,
            Some("bicubic") => Filter::Bicubic,
            Some("nearest") => Filter::Nearest,
            Some("lanczos") => Filter::Lanczos3,
            Some(i) => return Err(format!("`interpolation` {i:?} is not supported")),
        };
        let three = |key| -> Result<[f32; 3], String> {
            let v = floats(key, 3)?;
            Ok([v[0] as f32, v[1] as f32, v[2] as f32])
        };
        let spec = Self {
            input_size: [h, w],
            resize: Resize::ShorterSide((f64::from(h.min(w)) / crop_pct).floor() as u32),
            filter,
            crop: Crop::Center,
            alpha: Alpha::Drop,
            channel_order: ChannelOrder::Rgb,
            scale: 1.0 / 255.0,
            mean: three("mean")?,
            std: three("std")?,
        };
        spec.validate().map_err(|e| e.to_string())?;
        Ok(spec)
    }

    /// Number of f32 values one image becomes (`3 * H * W`).
    pub fn tensor_len(&self) -> usize {
        3 * self.input_size[0] as usize * self.input_size[1] as usize
    }

    /// Checks the spec itself (a manifest may come from anywhere).
    pub fn validate(&self) -> Result<(), PreprocessError> {
        let bad = |why: String| Err(PreprocessError::Spec(why));
        let [h, w] = self.input_size;
        if h == 0 || w == 0 {
            return bad(format!("input_size {h}x{w} must be positive"));
        }
        if self.std.iter().any(|s| *s == 0.0 || !s.is_finite()) {
            return bad(format!("std {:?} must be finite and non-zero", self.std));
        }
        match (self.resize, self.crop) {
            (Resize::ShorterSide(0), _) => bad("resize.shorter_side must be positive".into()),
            (Resize::Exact([rh, rw]), Crop::None) if [rh, rw] != self.input_size => bad(format!(
                "resize {rh}x{rw} without crop must equal input_size {h}x{w}"
            )),
            (Resize::Exact([rh, rw]), Crop::Center) if rh < h || rw < w => {
                bad(format!("resize {rh}x{rw} is smaller than the crop {h}x{w}"))
            }
            (Resize::ShorterSide(s), Crop::Center) if s < h.min(w) => {
                bad(format!("shorter side {s} is smaller than the crop {h}x{w}"))
            }
            (Resize::ShorterSide(_), Crop::None) => {
                bad("shorter_side resize needs a centre crop to reach a fixed size".into())
            }
            _ => Ok(()),
        }
    }
}

/// Bounds on what a decoder may allocate, against decompression bombs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageLimits {
    pub max_width: u32,
    pub max_height: u32,
    /// Bytes the decoder may allocate in total.
    pub max_alloc: u64,
    /// Encoded bytes accepted at all.
    pub max_file_bytes: u64,
    /// JPEG and PNG only (a device's default: the formats cameras write, and less decoder code
    /// that untrusted bytes reach); else every format Kestrel decodes (BMP, GIF, TIFF too).
    #[serde(default)]
    pub jpeg_png_only: bool,
}

impl Default for ImageLimits {
    /// A workstation's: 8192 pixels a side, 512 MiB for the decoder, 64 MiB files, every format.
    fn default() -> Self {
        Self {
            max_width: 8192,
            max_height: 8192,
            max_alloc: 512 << 20,
            max_file_bytes: 64 << 20,
            jpeg_png_only: false,
        }
    }
}

impl ImageLimits {
    /// A device's (a Raspberry Pi with 1 GB): 4096 pixels a side (a 12 MP camera frame fits),
    /// 48 MiB for the decoder (a 16-bit or RGBA bomb of that size is refused before it is
    /// decoded), files up to `max_file_bytes`, JPEG and PNG only.
    pub fn device(max_file_bytes: u64) -> Self {
        Self {
            max_width: 4096,
            max_height: 4096,
            max_alloc: 48 << 20,
            max_file_bytes,
            jpeg_png_only: true,
        }
    }
}

/// Why an image could not become a tensor. Every variant names the image (`source`).
#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    #[error("{source_name}: empty input (0 bytes)")]
    Empty { source_name: String },
    #[error("{source_name}: {bytes} bytes exceeds the limit of {limit} bytes")]
    FileTooLarge {
        source_name: String,
        bytes: u64,
        limit: u64,
    },
    #[error("{source_name}: not a recognised image format (first bytes {magic})")]
    UnknownFormat { source_name: String, magic: String },
    #[error("{source_name}: {format} images are not accepted here (JPEG and PNG only)")]
    FormatNotAllowed { source_name: String, format: String },
    #[error("{source_name}: image {width}x{height} exceeds the limit {max_width}x{max_height}")]
    TooLarge {
        source_name: String,
        width: u32,
        height: u32,
        max_width: u32,
        max_height: u32,
    },
    #[error("{source_name}: cannot decode image")]
    Decode {
        source_name: String,
        #[source]
        source: image::ImageError,
    },
    #[error("{source_name}: cannot decode image: image {width}x{height} has no pixels")]
    NoPixels {
        source_name: String,
        width: u32,
        height: u32,
    },
    #[error("{source_name}: cannot read")]
    Io {
        source_name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid preprocessing spec: {0}")]
    Spec(String),
}

/// One preprocessed image: `CHW` f32, length [`PreprocessSpec::tensor_len`].
#[derive(Debug, Clone, PartialEq)]
pub struct Preprocessed {
    pub data: Vec<f32>,
    /// Size of the decoded image before resizing (width, height).
    pub original_size: (u32, u32),
}

impl Preprocessed {
    /// The tensor as raw little-endian f32 bytes (what both binaries' `preprocess` command writes).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        self.data.iter().flat_map(|v| v.to_le_bytes()).collect()
    }
}

/// Preprocesses each image file and writes its tensor as raw little-endian f32 to
/// `out/<file name>.f32` (what both binaries' `preprocess` command does).
pub fn dump_tensors(
    spec: &PreprocessSpec,
    images: &[std::path::PathBuf],
    out: &std::path::Path,
) -> Result<(), PreprocessError> {
    let io = |p: &std::path::Path, e: std::io::Error| PreprocessError::Io {
        source_name: p.display().to_string(),
        source: e,
    };
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    for img in images {
        let t = spec.run_file(img, &ImageLimits::default())?;
        let name = img
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "image".into());
        let path = out.join(format!("{name}.f32"));
        std::fs::write(&path, t.to_le_bytes()).map_err(|e| io(&path, e))?;
    }
    Ok(())
}

/// Decodes `bytes` with `limits`; `source_name` (a path, a row id, a topic) names the image in errors.
pub fn decode(
    bytes: &[u8],
    source_name: &str,
    limits: &ImageLimits,
) -> Result<DynamicImage, PreprocessError> {
    let source_name = source_name.to_string();
    if bytes.is_empty() {
        return Err(PreprocessError::Empty { source_name });
    }
    if bytes.len() as u64 > limits.max_file_bytes {
        return Err(PreprocessError::FileTooLarge {
            source_name,
            bytes: bytes.len() as u64,
            limit: limits.max_file_bytes,
        });
    }
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| PreprocessError::Io {
            source_name: source_name.clone(),
            source: e,
        })?;
    let format = reader.format();
    let allowed = |f: image::ImageFormat| {
        !limits.jpeg_png_only || matches!(f, image::ImageFormat::Jpeg | image::ImageFormat::Png)
    };
    if !format.is_some_and(allowed) {
        let magic = bytes
            .iter()
            .take(8)
            .map(|b| format!("{b:02x}"))
            .collect::<String>();
        return Err(match format {
            Some(f) => PreprocessError::FormatNotAllowed {
                source_name,
                format: format!("{f:?}"),
            },
            None => PreprocessError::UnknownFormat { source_name, magic },
        });
    }
    // Read the header first so an over-size image is named as such (not as an allocation failure).
    let (width, height) = reader
        .into_dimensions()
        .map_err(|e| PreprocessError::Decode {
            source_name: source_name.clone(),
            source: e,
        })?;
    if width > limits.max_width || height > limits.max_height {
        return Err(PreprocessError::TooLarge {
            source_name,
            width,
            height,
            max_width: limits.max_width,
            max_height: limits.max_height,
        });
    }
    let mut reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| PreprocessError::Io {
            source_name: source_name.clone(),
            source: e,
        })?;
    let mut l = image::Limits::default();
    l.max_image_width = Some(limits.max_width);
    l.max_image_height = Some(limits.max_height);
    l.max_alloc = Some(limits.max_alloc);
    reader.limits(l);
    let img = reader.decode().map_err(|e| PreprocessError::Decode {
        source_name: source_name.clone(),
        source: e,
    })?;
    // An image with no pixels (a GIF's 4x0 screen, found by fuzzing) would scale to an endless
    // size in the resize.
    if img.width() == 0 || img.height() == 0 {
        return Err(PreprocessError::NoPixels {
            source_name,
            width: img.width(),
            height: img.height(),
        });
    }
    Ok(img)
}

impl PreprocessSpec {
    /// Decodes and preprocesses encoded image bytes.
    pub fn run_bytes(
        &self,
        bytes: &[u8],
        source_name: &str,
        limits: &ImageLimits,
    ) -> Result<Preprocessed, PreprocessError> {
        let img = decode(bytes, source_name, limits)?;
        self.run_image(&img)
    }

    /// Reads a file and preprocesses it; errors name the path.
    pub fn run_file(
        &self,
        path: &std::path::Path,
        limits: &ImageLimits,
    ) -> Result<Preprocessed, PreprocessError> {
        let name = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|e| PreprocessError::Io {
            source_name: name.clone(),
            source: e,
        })?;
        if meta.len() > limits.max_file_bytes {
            return Err(PreprocessError::FileTooLarge {
                source_name: name,
                bytes: meta.len(),
                limit: limits.max_file_bytes,
            });
        }
        let bytes = std::fs::read(path).map_err(|e| PreprocessError::Io {
            source_name: name.clone(),
            source: e,
        })?;
        self.run_bytes(&bytes, &name, limits)
    }

    /// Preprocesses an already decoded image.
    pub fn run_image(&self, img: &DynamicImage) -> Result<Preprocessed, PreprocessError> {
        let pixels = self.to_pixels(img)?;
        Ok(Preprocessed {
            data: self.normalize(&pixels),
            original_size: (img.width(), img.height()),
        })
    }

    /// Steps 2-4: colour conversion, resize and crop, giving 8-bit RGB pixels of `input_size`.
    /// Caches store these (4x smaller than the f32 tensor); [`Self::normalize`] finishes the job.
    pub fn to_pixels(&self, img: &DynamicImage) -> Result<RgbImage, PreprocessError> {
        self.validate()?;
        let converted;
        let rgb = match img {
            DynamicImage::ImageRgb8(rgb) => rgb,
            _ => {
                converted = self.to_rgb8(img);
                &converted
            }
        };
        let [h, w] = self.input_size;
        let (rw, rh) = match self.resize {
            Resize::ShorterSide(s) => {
                let (iw, ih) = (rgb.width() as f64, rgb.height() as f64);
                let k = s as f64 / iw.min(ih);
                (
                    ((iw * k).round() as u32).max(1),
                    ((ih * k).round() as u32).max(1),
                )
            }
            Resize::Exact([eh, ew]) => (ew, eh),
        };
        // A resize cannot make a side smaller than the crop (validate() checks this for the
        // configured sizes; rounding of extreme aspect ratios is clamped here).
        let (rw, rh) = match self.crop {
            Crop::Center => (rw.max(w), rh.max(h)),
            Crop::None => (rw, rh),
        };
        // The window of the resized image the crop keeps.
        let window = match self.crop {
            Crop::Center => ((rw - w) / 2, (rh - h) / 2, w, h),
            Crop::None => (0, 0, rw, rh),
        };
        if (rw, rh) != (rgb.width(), rgb.height()) && self.filter == Filter::Bilinear {
            return Ok(crate::resize::triangle_rgb8_window(rgb, (rw, rh), window));
        }
        let resized = if (rw, rh) == (rgb.width(), rgb.height()) {
            rgb.clone()
        } else {
            image::imageops::resize(rgb, rw, rh, self.filter.into())
        };
        Ok(match window {
            (0, 0, ..) if (rw, rh) == (w, h) => resized,
            (x, y, w, h) => image::imageops::crop_imm(&resized, x, y, w, h).to_image(),
        })
    }

    /// Step 5: `((v * scale) - mean[c]) / std[c]`, CHW in the spec's channel order.
    /// `pixels` must be `input_size` (as [`Self::to_pixels`] returns).
    pub fn normalize(&self, pixels: &RgbImage) -> Vec<f32> {
        let [h, w] = self.input_size;
        assert_eq!(
            (pixels.width(), pixels.height()),
            (w, h),
            "normalize needs input_size pixels"
        );
        let mut data = vec![0f32; 3 * (h * w) as usize];
        self.normalize_into(pixels.as_raw(), &mut data);
        data
    }

    /// [`Self::normalize`] of raw RGB8 HWC pixels of `input_size` into `out` (3 x h x w values),
    /// so a batch is filled in place.
    pub fn normalize_into(&self, pixels: &[u8], out: &mut [f32]) {
        let [h, w] = self.input_size;
        let plane = (h * w) as usize;
        assert_eq!(pixels.len(), 3 * plane, "normalize needs input_size pixels");
        assert_eq!(
            out.len(),
            3 * plane,
            "normalize writes 3 x input_size values"
        );
        let order: [usize; 3] = match self.channel_order {
            ChannelOrder::Rgb => [0, 1, 2],
            ChannelOrder::Bgr => [2, 1, 0],
        };
        let (planes, rest) = out.split_at_mut(plane);
        let (p1, p2) = rest.split_at_mut(plane);
        let outs = [planes, p1, p2];
        for (dst, src) in outs.into_iter().zip(order) {
            let (scale, mean, std) = (self.scale, self.mean[src], self.std[src]);
            for (o, p) in dst.iter_mut().zip(pixels.chunks_exact(3)) {
                *o = (p[src] as f32 * scale - mean) / std;
            }
        }
    }

    fn to_rgb8(&self, img: &DynamicImage) -> RgbImage {
        match self.alpha {
            Alpha::Blend(bg) if img.color().has_alpha() => {
                let rgba = img.to_rgba8();
                let mut out = RgbImage::new(rgba.width(), rgba.height());
                for (o, p) in out.pixels_mut().zip(rgba.pixels()) {
                    let a = p.0[3] as u32;
                    for c in 0..3 {
                        o.0[c] = ((p.0[c] as u32 * a + bg[c] as u32 * (255 - a) + 127) / 255) as u8;
                    }
                }
                out
            }
            _ => img.to_rgb8(),
        }
    }
}

impl From<Filter> for FilterType {
    fn from(f: Filter) -> Self {
        match f {
            Filter::Nearest => FilterType::Nearest,
            Filter::Bilinear => FilterType::Triangle,
            Filter::Bicubic => FilterType::CatmullRom,
            Filter::Lanczos3 => FilterType::Lanczos3,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{ImageBuffer, Luma, Rgba};

    fn png(img: DynamicImage) -> Vec<u8> {
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png).unwrap();
        out.into_inner()
    }

    #[test]
    fn shape_and_normalisation() {
        let spec = PreprocessSpec::tf_inception();
        let img =
            DynamicImage::ImageRgb8(RgbImage::from_pixel(300, 400, image::Rgb([255, 0, 128])));
        let out = spec
            .run_bytes(&png(img), "solid.png", &ImageLimits::default())
            .unwrap();
        assert_eq!(out.data.len(), 3 * 224 * 224);
        assert_eq!(out.original_size, (300, 400));
        assert!((out.data[0] - 1.0).abs() < 1e-6);
        assert!((out.data[224 * 224] + 1.0).abs() < 1e-6);
        assert!((out.data[2 * 224 * 224] - (128.0 / 255.0 - 0.5) / 0.5).abs() < 1e-6);
    }

    #[test]
    fn gray_16bit_and_rgba_convert() {
        let spec = PreprocessSpec::imagenet();
        let g16: ImageBuffer<Luma<u16>, Vec<u16>> = ImageBuffer::from_pixel(10, 10, Luma([65535]));
        let out = spec
            .run_bytes(
                &png(DynamicImage::ImageLuma16(g16)),
                "g16.png",
                &ImageLimits::default(),
            )
            .unwrap();
        for c in 0..3 {
            let want = (1.0 - spec.mean[c]) / spec.std[c];
            assert!((out.data[c * 224 * 224 + 5] - want).abs() < 1e-5);
        }
        let rgba = ImageBuffer::from_pixel(10, 10, Rgba([200u8, 100, 0, 0]));
        let drop = spec
            .run_image(&DynamicImage::ImageRgba8(rgba.clone()))
            .unwrap();
        let blend = PreprocessSpec {
            alpha: Alpha::Blend([0, 0, 0]),
            ..spec.clone()
        }
        .run_image(&DynamicImage::ImageRgba8(rgba))
        .unwrap();
        assert!((drop.data[0] - (200.0 / 255.0 - 0.485) / 0.229).abs() < 1e-5);
        assert!((blend.data[0] - (0.0 - 0.485) / 0.229).abs() < 1e-5);
    }

    #[test]
    fn bad_inputs_name_the_source() {
        let spec = PreprocessSpec::imagenet();
        let lim = ImageLimits::default();
        let e = spec.run_bytes(&[], "a.png", &lim).unwrap_err();
        assert!(matches!(e, PreprocessError::Empty { .. }) && e.to_string().contains("a.png"));
        let e = spec
            .run_bytes(b"hello world, not an image", "b.jpg", &lim)
            .unwrap_err();
        assert!(matches!(e, PreprocessError::UnknownFormat { .. }), "{e}");
        let good = png(DynamicImage::ImageRgb8(RgbImage::new(64, 64)));
        let e = spec
            .run_bytes(&good[..good.len() / 2], "c.png", &lim)
            .unwrap_err();
        assert!(
            matches!(e, PreprocessError::Decode { .. }) && e.to_string().contains("c.png"),
            "{e}"
        );
        // The decoder's own words are the error's source, and in its one-line form.
        let why = std::error::Error::source(&e)
            .expect("decoder error kept")
            .to_string();
        let line = crate::chain(&e);
        assert!(
            line.starts_with("c.png: cannot decode image: ") && line.ends_with(&why),
            "{line}"
        );
        let small = ImageLimits {
            max_width: 32,
            max_height: 32,
            ..lim
        };
        let e = spec.run_bytes(&good, "d.png", &small).unwrap_err();
        assert!(
            matches!(e, PreprocessError::TooLarge { width: 64, .. }),
            "{e}"
        );
    }

    /// Fuzzing found it (fuzz/fuzz_targets/image_preprocess.rs): a 79-byte GIF with a 4x0 screen
    /// asked the resize for an endless allocation.
    #[test]
    fn an_image_without_pixels_is_refused() {
        let gif = b"GIF87a\x04\x00\x00\x00\x81?\x00\x01\xf2\x03\x00\x00\x00\x00\x00\x00\x00\x00\x00,\x00\x00\x00\x00\x04\x00\x04\x00i\x08q\x142\x81\x91\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x81\x00\x00\x01\x02\x03\x00\x00\x00\x00\x00\x00\x00\x89/PNG\r\x00\x04\x00\x80\x00;";
        assert_eq!(gif.len(), 79);
        let e = PreprocessSpec::tf_inception()
            .run_bytes(gif, "zero.gif", &ImageLimits::default())
            .unwrap_err();
        assert!(
            matches!(
                e,
                PreprocessError::Decode { .. } | PreprocessError::NoPixels { .. }
            ) && e.to_string().contains("zero.gif"),
            "{e}"
        );
    }

    #[test]
    fn spec_round_trips_through_json() {
        let spec = PreprocessSpec::tf_inception();
        let json = serde_json::to_string(&spec).unwrap();
        assert_eq!(serde_json::from_str::<PreprocessSpec>(&json).unwrap(), spec);
        let bad = PreprocessSpec {
            std: [0.0, 1.0, 1.0],
            ..spec
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn timm_and_hugging_face_configs() {
        let cfg = serde_json::json!({
            "architecture": "mobilenetv3_large_100",
            "pretrained_cfg": {
                "input_size": [3, 224, 224], "interpolation": "bicubic", "crop_pct": 0.875,
                "crop_mode": "center", "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]
            }
        });
        let spec = PreprocessSpec::from_timm_config(&cfg).unwrap();
        assert_eq!(spec.resize, Resize::ShorterSide(256));
        assert_eq!(spec.filter, Filter::Bicubic);
        assert_eq!(spec.mean, PreprocessSpec::imagenet().mean);
        let plain = PreprocessSpec::from_timm_config(&cfg["pretrained_cfg"]).unwrap();
        assert_eq!(plain, spec);
        let mut wide = cfg["pretrained_cfg"].clone();
        wide["input_size"] = serde_json::json!([3, 288, 288]);
        wide["crop_pct"] = serde_json::json!(1.0);
        let spec = PreprocessSpec::from_timm_config(&wide).unwrap();
        assert_eq!(
            (spec.input_size, spec.resize),
            ([288, 288], Resize::ShorterSide(288))
        );
        let mut bad = cfg["pretrained_cfg"].clone();
        bad.as_object_mut().unwrap().remove("std");
        assert!(
            PreprocessSpec::from_timm_config(&bad)
                .unwrap_err()
                .contains("`std`")
        );
        bad["std"] = serde_json::json!([1, 1, 1]);
        bad["crop_mode"] = serde_json::json!("squash");
        assert!(
            PreprocessSpec::from_timm_config(&bad)
                .unwrap_err()
                .contains("crop_mode")
        );
    }
}
