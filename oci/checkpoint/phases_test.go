package checkpoint

import (
	"errors"
	"reflect"
	"testing"
	"time"
)

// stepClock returns a clock that advances by step on every reading.
func stepClock(step time.Duration) func() time.Time {
	t := time.Unix(0, 0)
	return func() time.Time {
		t = t.Add(step)
		return t
	}
}

func TestPhases(t *testing.T) {
	p := NewPhases(stepClock(1500 * time.Microsecond))
	end := p.Start("lock")
	end()
	end() // a second end records nothing
	boom := errors.New("boom")
	if err := p.Time("dump", func() error { return boom }); !errors.Is(err, boom) {
		t.Errorf("Time returned %v, want fn's error", err)
	}
	n := p.Len()
	p.Add(Phase{Name: "gpu-restore", Ms: 2})
	want := []Phase{{Name: "lock", Ms: 1.5}, {Name: "dump", Ms: 1.5}, {Name: "gpu-restore", Ms: 2}}
	if got := p.List(); !reflect.DeepEqual(got, want) {
		t.Errorf("phases %+v, want %+v", got, want)
	}
	if got := p.List()[n:]; len(got) != 1 || got[0].Name != "gpu-restore" {
		t.Errorf("phases after Len(): %+v", got)
	}
	l := p.List()
	l[0].Name = "changed"
	if p.List()[0].Name != "lock" {
		t.Error("List does not return a copy")
	}
	if got := NewPhases(nil).List(); got != nil {
		t.Errorf("empty Phases lists %+v", got)
	}
}
