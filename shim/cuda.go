package shim

import (
	"fmt"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/cuda"
	"github.com/berth-dev/berth/gpu/nvidia"
	"github.com/berth-dev/berth/gpu/nvml"
)

func init() {
	cudaBackend = func() (gpu.Backend, error) {
		drv, err := cuda.Load("")
		if err != nil {
			return nil, fmt.Errorf("CUDA checkpoint driver: %w", err)
		}
		inv, err := nvml.Open()
		if err != nil {
			return nil, fmt.Errorf("NVML inventory: %w", err)
		}
		return &nvidia.Backend{Drv: drv, Inv: inv}, nil
	}
}
