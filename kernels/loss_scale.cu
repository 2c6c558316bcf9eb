// Dynamic loss scaling's update after a step (torch.amp.GradScaler's rule), one thread, all on
// the device so a captured step needs no host sync:
//     found_inf:  scale *= backoff_factor, tracker = 0
//     otherwise:  tracker += 1; when it reaches growth_interval, scale *= growth_factor (kept
//                 only if finite) and tracker = 0
#include "common.cuh"

extern "C" __global__ void update_loss_scale(float* scale, int* tracker, const float* found_inf,
                                             float growth_factor, float backoff_factor,
                                             int growth_interval)
{
    if (*found_inf != 0.0f) {
        *scale *= backoff_factor;
        *tracker = 0;
        return;
    }
    const int successful = *tracker + 1;
    if (successful == growth_interval) {
        const float grown = *scale * growth_factor;
        if (isfinite(grown))
            *scale = grown;
        *tracker = 0;
    } else {
        *tracker = successful;
    }
}
