package commands

import (
	"fmt"
	"strings"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// deviceMapRule says how a restore maps the checkpoint's GPUs (gpu/devicemap), with the links
// between them the checkpoint recorded: "onto the same GPUs when all are there, else idle GPUs of
// the same model before GPUs in use, keeping links 0-1 NV4".
func deviceMapRule(g *checkpoint.GPUState) string {
	rule := "onto the same GPUs when all are on the node with the free memory, else GPUs of the same model with the free memory, idle ones before those in use"
	var links []string
	for i, row := range g.Links {
		for j := i + 1; j < len(row); j++ {
			links = append(links, fmt.Sprintf("%d-%d %s", i, j, row[j]))
		}
	}
	switch {
	case len(links) > 0:
		rule += ", keeping the links " + strings.Join(links, ", ") + " where a set of the node has them"
	case len(g.Devices) > 1:
		rule += " (links between the GPUs not recorded)"
	}
	return rule + "; the restore log and berth-restore.json in the bundle name the choice and the GPUs passed over"
}
