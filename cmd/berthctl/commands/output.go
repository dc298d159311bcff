package commands

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/spf13/pflag"
)

// Output formats of -o/--output.
const (
	formatText = "text"
	formatJSON = "json"
	formatYAML = "yaml"
)

// format is the value of -o/--output: one of the formats a command offers. A value it does not
// offer is refused while the flags are parsed, with an error naming the flag and the value.
type format struct {
	value   string
	allowed []string
}

func (f *format) String() string { return f.value }
func (f *format) Type() string   { return "format" }

func (f *format) Set(v string) error {
	if !slices.Contains(f.allowed, v) {
		return fmt.Errorf("want %s", strings.Join(f.allowed, " or "))
	}
	f.value = v
	return nil
}

// json reports whether JSON was asked for.
func (f *format) json() bool { return f.value == formatJSON }

// addFormat registers -o/--output on fs with the formats allowed, the first one the default.
func addFormat(fs *pflag.FlagSet, allowed ...string) *format {
	f := &format{value: allowed[0], allowed: allowed}
	fs.VarP(f, "output", "o", "output format: "+strings.Join(allowed, " or "))
	return f
}

// writeJSON writes v as indented JSON and a newline.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// millis is d in milliseconds, to a microsecond: how berth reports durations (checkpoint.Phase).
func millis(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func us(v uint32) float64 { return float64(v) / 1000 }

func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// deprecatedAlias registers old as a hidden, deprecated name of the string flag name, bound to
// the same variable p: a command line that still uses old works, and is told to use name.
func deprecatedAlias(fs *pflag.FlagSet, p *string, old, name string) {
	fs.StringVar(p, old, *p, "use --"+name)
	_ = fs.MarkDeprecated(old, "use --"+name+" instead")
}
