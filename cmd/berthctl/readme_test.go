package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestREADMECommands: every berthctl command line the README documents names a command berthctl
// has, and every flag on it is one that command takes (its own or a global one).
func TestREADMECommands(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	flagRe := regexp.MustCompile(`^--?[a-zA-Z][a-zA-Z-]*`)
	var lines []string
	inCode, cont := false, false
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "```") {
			inCode = !inCode
			continue
		}
		if !inCode {
			continue
		}
		l = strings.TrimSpace(strings.SplitN(l, "  #", 2)[0])
		switch {
		case cont:
			lines[len(lines)-1] += " " + strings.TrimSuffix(l, `\`)
		case strings.HasPrefix(l, "berthctl "):
			lines = append(lines, strings.TrimSuffix(l, `\`))
		default:
			continue
		}
		cont = strings.HasSuffix(l, `\`)
	}
	if len(lines) < 10 {
		t.Fatalf("found %d berthctl command lines in README.md, want the documented list", len(lines))
	}
	root := newRoot(env(nil))
	for _, line := range lines {
		fields := strings.Fields(strings.NewReplacer("[", " ", "]", " ", "|", " | ").Replace(line))[1:]
		var path []string
		for _, f := range fields {
			if strings.HasPrefix(f, "-") || strings.ToUpper(f) == f {
				break
			}
			path = append(path, f)
		}
		cmd, _, err := root.Find(path)
		if err != nil || cmd == root {
			t.Errorf("README: %q: no command %q", line, strings.Join(path, " "))
			continue
		}
		for _, f := range fields {
			name := flagRe.FindString(f)
			if name == "" {
				continue
			}
			var ok bool
			if strings.HasPrefix(name, "--") {
				ok = cmd.Flags().Lookup(name[2:]) != nil || cmd.InheritedFlags().Lookup(name[2:]) != nil
			} else {
				ok = cmd.Flags().ShorthandLookup(name[1:]) != nil || cmd.InheritedFlags().ShorthandLookup(name[1:]) != nil
			}
			if !ok {
				t.Errorf("README: %q: %s takes no flag %s", line, cmd.CommandPath(), name)
			}
		}
	}
}
