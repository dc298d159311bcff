package privilege

import (
	"errors"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

func TestCheckHooks(t *testing.T) {
	ldcache := specs.Hook{Path: "/usr/bin/nvidia-cdi-hook", Args: []string{"nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib64"}}
	src := HooksOf(&specs.Spec{Hooks: &specs.Hooks{CreateContainer: []specs.Hook{ldcache}}})
	for _, tc := range []struct {
		name  string
		hooks *specs.Hooks
		want  string // "" for allowed, else a part of the error
	}{
		{"no hooks", nil, ""},
		{"the source's own hook", &specs.Hooks{CreateContainer: []specs.Hook{ldcache}}, ""},
		{"a hook the source did not run", &specs.Hooks{CreateRuntime: []specs.Hook{{Path: "/bin/sh", Args: []string{"sh", "-c", "id"}}}}, "createRuntime /bin/sh -c id"},
		{"the same path at another time", &specs.Hooks{Poststart: []specs.Hook{ldcache}}, "poststart /usr/bin/nvidia-cdi-hook"},
		{"other arguments", &specs.Hooks{CreateContainer: []specs.Hook{{Path: ldcache.Path, Args: []string{"nvidia-cdi-hook", "update-ldcache", "--folder", "/tmp"}}}}, "--folder /tmp"},
		{"the source's hook twice", &specs.Hooks{CreateContainer: []specs.Hook{ldcache, ldcache}}, "update-ldcache"},
		{"the source's hook with another timeout", &specs.Hooks{CreateContainer: []specs.Hook{{Path: ldcache.Path, Args: ldcache.Args, Timeout: new(int)}}}, "update-ldcache"},
		{"an added environment", &specs.Hooks{CreateContainer: []specs.Hook{{Path: ldcache.Path, Args: ldcache.Args, Env: []string{"LD_PRELOAD=/tmp/x.so"}}}}, "hook"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckHooks(src, &specs.Spec{Hooks: tc.hooks})
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if !errors.Is(err, ErrExceedsSpec) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("CheckHooks = %v, want ErrExceedsSpec naming %q", err, tc.want)
			}
		})
	}
}

func TestFromSpecRecordsHooks(t *testing.T) {
	//lint:ignore SA1019 runc still runs prestart hooks
	s := &specs.Spec{Process: &specs.Process{}, Hooks: &specs.Hooks{Prestart: []specs.Hook{{Path: "/a"}}, Poststop: []specs.Hook{{Path: "/b"}}}}
	got := FromSpec(s).Hooks
	if len(got) != 2 || got[0].Kind != "prestart" || got[1].Kind != "poststop" {
		t.Fatalf("FromSpec hooks = %+v", got)
	}
	if err := CheckContainer(Container{Namespaces: FromSpec(s).Namespaces}, s); err != nil {
		t.Fatalf("CheckContainer must leave hooks to CheckHooks: %v", err)
	}
}
