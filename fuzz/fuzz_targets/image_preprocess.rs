//! An inference request's bytes: decode under the device's limits, then preprocess as Lite0's
//! spec says. Errors are fine; panics, hangs and allocations past the limits are not.
#![no_main]

use kestrel_shared::{ImageLimits, PreprocessSpec};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Every format a device can be configured to take ([limits] any_image_format).
    let limits = ImageLimits {
        jpeg_png_only: false,
        ..ImageLimits::device(2 << 20)
    };
    let spec = PreprocessSpec::tf_inception();
    if let Ok(t) = spec.run_bytes(data, "fuzz", &limits) {
        assert_eq!(t.data.len(), spec.tensor_len());
    }
});
