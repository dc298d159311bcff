package scenario

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/berth-dev/berth/test/workload/client"
	"github.com/berth-dev/berth/test/workload/model"
)

// sessions are n inference sessions streamed from a source while a move runs: each asks for
// tokens tokens of "tell me story number i" and, when the source stops answering, waits for the
// move's outcome and resumes on the destination at the next token.
type sessions struct {
	reached, done sync.WaitGroup
	moved         chan struct{}
	dst           client.Target
	moveErr       error
	// streams are the tokens each session received, resumedAt the token index at which it
	// went on on the destination (-1: never), errs each stream's error.
	streams   [][]string
	resumedAt []int
	errs      []error
}

// streamSessions starts n sessions on src and returns once each streams; waitPast then waits
// until each has passed token moveAfter (or lost the source).
func streamSessions(ctx context.Context, src client.Target, n, tokens, moveAfter int) *sessions {
	s := &sessions{moved: make(chan struct{}), streams: make([][]string, n), resumedAt: make([]int, n), errs: make([]error, n)}
	s.reached.Add(n)
	for i := range n {
		s.resumedAt[i] = -1
		s.done.Add(1)
		go func() {
			defer s.done.Done()
			var once sync.Once
			next := 0
			req := client.Request{
				Session: fmt.Sprintf("s%d", i), Prompt: prompt(i), N: tokens, IdleTimeout: 90 * time.Second,
				OnToken: func(idx int, _ string) {
					next = idx + 1
					if next >= moveAfter {
						once.Do(s.reached.Done)
					}
				},
			}
			s.streams[i], s.errs[i] = client.Resume(ctx, src, req, func(ctx context.Context, attempt int, err error) (client.Target, error) {
				once.Do(s.reached.Done)
				select {
				case <-s.moved:
				case <-ctx.Done():
					return client.Target{}, ctx.Err()
				}
				if s.moveErr != nil {
					return client.Target{}, s.moveErr
				}
				if attempt > 5 {
					return client.Target{}, fmt.Errorf("gave up after %d reconnects: %w", attempt, err)
				}
				s.resumedAt[i] = next
				return s.dst, nil
			})
		}()
	}
	return s
}

// waitPast waits until every session has passed the move point.
func (s *sessions) waitPast() { s.reached.Wait() }

// finish hands the sessions the move's outcome (the destination, or why there is none), waits
// for every stream to end and returns moveErr, else the first stream's error naming its session.
func (s *sessions) finish(dst client.Target, moveErr error) error {
	s.dst, s.moveErr = dst, moveErr
	close(s.moved)
	s.done.Wait()
	if moveErr != nil {
		return moveErr
	}
	for i, err := range s.errs {
		if err != nil {
			return fmt.Errorf("session s%d: %w", i, err)
		}
	}
	return nil
}

// compare fills reference with what an uninterrupted run of cfg answers each session and returns
// how many sessions received exactly that.
func (s *sessions) compare(cfg model.Config, tokens int) (reference [][]string, matching int, err error) {
	m, err := model.New(cfg)
	if err != nil {
		return nil, 0, err
	}
	reference = make([][]string, len(s.streams))
	for i := range s.streams {
		for _, t := range m.Reference(prompt(i), tokens) {
			reference[i] = append(reference[i], t.Word())
		}
		if equal(s.streams[i], reference[i]) {
			matching++
		}
	}
	return reference, matching, nil
}

func prompt(i int) string { return fmt.Sprintf("tell me story number %d", i) }
