package topology

import (
	"errors"
	"reflect"
	"slices"
	"testing"
)

func TestLinkRankOrder(t *testing.T) {
	// Ascending bandwidth, as documented on Rank.
	order := []Link{{}, SYS, NODE, PHB, PXB, PIX, NV(1), NV(2), NV(12), NV(18), NV(MaxNVLinks), Self}
	for i := 1; i < len(order); i++ {
		if order[i-1].Rank() >= order[i].Rank() {
			t.Errorf("rank(%s)=%d not below rank(%s)=%d", order[i-1], order[i-1].Rank(), order[i], order[i].Rank())
		}
	}
}

func TestParseLink(t *testing.T) {
	tests := []struct {
		in   string
		want Link
		err  bool
	}{
		{" X ", Self, false}, {"NV1", NV(1), false}, {"NV18", NV(18), false}, {"NV255", NV(255), false},
		{"PIX", PIX, false}, {"PXB", PXB, false}, {"PHB", PHB, false}, {"NODE", NODE, false},
		{"SYS", SYS, false}, {"SOC", SYS, false},
		{"", Link{}, true}, {"NV", Link{}, true}, {"NV0", Link{}, true}, {"NV256", Link{}, true},
		{"NV-1", Link{}, true}, {"NV+1", Link{}, true}, {"nv2", Link{}, true}, {"sys", Link{}, true},
		{"NV99999999999999999999", Link{}, true}, {"QPI", Link{}, true},
	}
	for _, tc := range tests {
		got, err := ParseLink(tc.in)
		if (err != nil) != tc.err || got != tc.want {
			t.Errorf("ParseLink(%q) = %v, %v; want %v, error %v", tc.in, got, err, tc.want, tc.err)
		}
		if err != nil && !errors.Is(err, ErrMalformed) {
			t.Errorf("ParseLink(%q) error %v does not wrap ErrMalformed", tc.in, err)
		}
		if err == nil {
			if back, _ := ParseLink(got.String()); back != got {
				t.Errorf("ParseLink(%q).String() = %q does not parse back", tc.in, got)
			}
		}
	}
	if (Link{}).String() != "?" || (Link{Kind: LinkPIX, NVLinks: 3}).Valid() {
		t.Error("invalid links must print ? and not be Valid")
	}
}

func TestIDList(t *testing.T) {
	tests := []struct {
		in   string
		want []int
		err  bool
		back string
	}{
		{"0-3,8", []int{0, 1, 2, 3, 8}, false, "0-3,8"},
		{" 0-1,112-113 ", []int{0, 1, 112, 113}, false, "0-1,112-113"},
		{"0,3-5,11", []int{0, 3, 4, 5, 11}, false, "0,3-5,11"},
		{"5,1,3", []int{1, 3, 5}, false, "1,3,5"},
		{"7", []int{7}, false, "7"},
		{"", []int{}, false, ""},
		{"3-1", nil, true, ""}, {"1,,2", nil, true, ""}, {"a", nil, true, ""}, {"-1", nil, true, ""},
		{"1-", nil, true, ""}, {"1-2-3", nil, true, ""}, {"0-3,2", nil, true, ""}, {"65536", nil, true, ""},
		{"0-65535,0-65535", nil, true, ""}, {"+1", nil, true, ""},
	}
	for _, tc := range tests {
		got, err := ParseIDList(tc.in)
		if (err != nil) != tc.err || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ParseIDList(%q) = %v, %v; want %v, error %v", tc.in, got, err, tc.want, tc.err)
			continue
		}
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Errorf("ParseIDList(%q): %v does not wrap ErrMalformed", tc.in, err)
			}
			continue
		}
		if s := FormatIDList(got); s != tc.back {
			t.Errorf("FormatIDList(%v) = %q, want %q", got, s, tc.back)
		}
	}
	in := []int{3, 1, 2, 2}
	if s := FormatIDList(in); s != "1-3" || !slices.Equal(in, []int{3, 1, 2, 2}) {
		t.Errorf("FormatIDList(%v) = %q (or changed its argument)", in, s)
	}
}
