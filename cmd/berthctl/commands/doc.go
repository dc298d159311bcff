// Package commands holds berthctl's commands. Each constructor returns one cobra command with its
// flags and calls into berth's packages; berthctl's main chooses the commands, nests and groups
// them, and runs the root.
//
// What belongs here: flags, their validation (every error names the flag or value at fault),
// and the rendering of results as text or JSON (-o). What does not: the work itself (packages
// move, oci/..., nri/..., gpu/...) and which commands berthctl has (main).
package commands
